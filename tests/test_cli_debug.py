"""graphkern debug: the root cause printed and the exit status, on the planted bugs."""

from __future__ import annotations

import json
import textwrap

import pytest
import viz_graphs as vg
from click.testing import CliRunner

from graphkern.cli import main

MODELS = textwrap.dedent('''
    import planted_bugs as pb

    broken = pb.nan_llama()
    stock = pb.llama()
    patched = pb.swiglu_off_llama()
''')


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("debug") / "debug_targets.py"
    path.write_text(MODELS)
    return str(path)


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_the_planted_nan_kernel_is_printed_and_exits_1(models: str, tmp_path) -> None:
    html, doc = tmp_path / "v.html", tmp_path / "v.json"
    code, out, _ = _run("debug", f"{models}:broken", "-i", "2,8:int32", "--html", str(html),
                        "--json", str(doc))
    assert code == 1
    assert "root cause: nan_sqrt (kernel nan_sqrt) in model.layers.3.post_attention_layernorm" in out
    assert "NaN" in out and "while all its inputs are finite" in out
    graph = json.loads(doc.read_text())
    root = next(n for n in graph["nodes"] if n["id"] == "nan_sqrt")
    assert root["status"] == 12 and root["stats"]["nan"] > 0
    assert "nan_sqrt" in html.read_text()


def test_a_clean_model_exits_0(models: str) -> None:
    code, out, _ = _run("debug", f"{models}:stock", "-i", "2,8:int32")
    assert code == 0 and "all values finite" in out


@pytest.mark.slow
def test_compare_names_the_first_divergence_and_exits_1(models: str, tmp_path) -> None:
    html, doc = tmp_path / "c.html", tmp_path / "c.json"
    code, out, _ = _run("debug", f"{models}:patched", "-i", "2,8:int32", "--compare", f"{models}:stock",
                        "--html", str(html), "--json", str(doc))
    assert code == 1
    assert "first divergence: swiglu_off (Multiply -> swiglu_off) in model.layers.3.mlp" in out
    assert json.loads(doc.read_text())["first_divergence"]["b"] == "swiglu_off"
    page = vg.page_data(html.read_text())   # the viewer, on the first divergence
    compared = page["values"]["compare"]
    assert page["nodes"][compared["rows"][compared["first"]][0]][0] == "swiglu_off"
    code, out, _ = _run("debug", f"{models}:stock", "-i", "2,8:int32", "--compare", f"{models}:stock")
    assert code == 0 and "no divergence" in out


def test_full_tensors_on_request(models: str, tmp_path) -> None:
    code, _, _ = _run("debug", f"{models}:stock", "-i", "2,8:int32", "--save", str(tmp_path / "v.npz"))
    assert code == 0 and (tmp_path / "v.npz").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["{m}:nowhere", "-i", "2,8:int32"], "has no callable 'nowhere'"),
    (["{m}:stock", "-i", "2,8:int99"], "unknown dtype 'int99'"),
    (["{m}:stock", "-i", "2,8:int32", "--save", "{t}/v.pt"], "must end in .npz or .safetensors"),
    (["{m}:stock", "-i", "2,8:int32", "--json", "{t}/missing/v.json"], "does not exist"),
    (["{m}:stock", "-i", "2,8:int32", "--compare", "{m}:stock", "--save", "{t}/v.npz"],
     "leave out --compare"),
])
def test_bad_input_exits_2_with_a_clear_error(models: str, tmp_path, args, message) -> None:
    code, _, err = _run("debug", *[a.format(m=models, t=tmp_path) for a in args])
    assert code == 2 and message in err
    assert not list(tmp_path.iterdir())
