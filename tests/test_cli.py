"""The graphkern command line: trace, show, diff, view and --help; exit statuses; bad input gives a
clear message, exit status 2 and no files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import viz_graphs as vg
from click.testing import CliRunner

from graphkern.cli import main

MODEL = textwrap.dedent('''
    import mlx.core as mx
    import mlx.nn as nn
    import graphkern as gk

    K = gk.Kernel("scale_add", ["x", "y"], ["out"],
                  metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
                  reference=lambda x, y: [x * 2 + y])

    def _launch(x, y, tg):
        return gk.apply_in_graph(K, [x, y], [gk.OutputSpec(x.shape, x.dtype)],
                                 grid=(x.size, 1, 1), threadgroup=tg,
                                 template=[("T", x.dtype)]).outputs[0]

    def forward(x, y):
        return mx.tanh(_launch(x, y, (256, 1, 1))) + 1

    def broken(x, y):
        return mx.tanh(_launch(x, y, (0, 1, 1))) + 1

    def raises(x):
        raise ValueError("boom")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def __call__(self, x):
            return self.proj(x).sum()

    NOT_CALLABLE = 3
''')


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mymodel.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mymodel", None)
    return tmp_path


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name != "__pycache__"}


# ----------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", ["trace", "show", "diff", "view"])
def test_help_on_each_command(command: str) -> None:
    r = run(command, "--help")
    assert r.exit_code == 0 and "Usage:" in r.output and command in r.output


def test_group_help_lists_the_commands() -> None:
    r = run("--help")
    for command in ("demo", "trace", "show", "diff", "view"):
        assert command in r.output


def test_python_dash_m_entry_point() -> None:
    r = subprocess.run([sys.executable, "-m", "graphkern", "trace", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "MODULE:CALLABLE" in r.stdout


def test_the_demo_ends_saying_what_its_last_number_is() -> None:
    """The last line names the number it prints (the sum of the logits) and matches step 2's."""
    import re

    r = run("demo", "--no-files")
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    compiled = re.search(r"compiled logits \(2, 16, 128\) float32, their sum (-?[0-9.]+);", r.output)
    assert compiled is not None, r.output
    assert lines[-1].startswith("after the refused call, the repaired model runs compiled again: the sum "
                                f"of its logits is {compiled.group(1)}, as in step 2")
    assert "still works" not in r.output


# ----------------------------------------------------------------------------- trace


def test_trace_writes_every_format(work: Path) -> None:
    r = run("trace", "mymodel.py:forward", "-i", "4,8:float32", "--input", "4x8",
            "--json", "g.json", "--html", "g.html", "--dot", "g.dot",
            "--model-explorer", "g.me.json")
    assert r.exit_code == 0, r.output
    assert "graph forward" in r.output and "kernels: scale_add" in r.output
    assert "status: OK" in r.output
    assert files(work) == {"mymodel.py", "g.json", "g.html", "g.dot", "g.me.json"}
    import graphkern as gk

    g = gk.Graph.from_json((work / "g.json").read_text())
    assert g.kernels() == ["scale_add"]
    assert (work / "g.html").read_text().startswith("<!DOCTYPE html>")
    assert (work / "g.dot").read_text().startswith('digraph "forward"')
    assert json.loads((work / "g.me.json").read_text())["label"] == "forward"


def test_trace_svg_and_png(work: Path) -> None:
    pytest.importorskip("graphviz")
    import shutil

    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed")
    r = run("trace", "mymodel:forward", "-i", "8", "-i", "8", "--svg", "g.svg", "--png", "g.png")
    assert r.exit_code == 0, r.output
    assert "<svg" in (work / "g.svg").read_text()
    assert (work / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_trace_a_class_is_instantiated(work: Path) -> None:
    r = run("trace", "mymodel:Model", "-i", "2,8", "--json", "m.json", "--table")
    assert r.exit_code == 0, r.output
    assert "proj.weight" in r.output  # the per-node table
    doc = json.loads((work / "m.json").read_text())
    assert any(n["scope"] == "proj" for n in doc["nodes"])


def test_trace_failed_graph_exits_1_and_still_writes(work: Path) -> None:
    r = run("trace", "mymodel.py:broken", "-i", "8:float32", "-i", "8:float32",
            "--json", "b.json", "--html", "b.html")
    assert r.exit_code == 1
    assert "FAILED: scale_add: INVALID_LAUNCH" in r.output
    assert files(work) == {"mymodel.py", "b.json", "b.html"}


def test_trace_function_that_raises_exits_1(work: Path) -> None:
    r = run("trace", "mymodel:raises", "-i", "3", "--json", "x.json")
    assert r.exit_code == 1 and "boom" in r.output
    assert files(work) == {"mymodel.py"}


@pytest.mark.parametrize("target, message", [
    ("nosuchmodule:forward", "cannot import module 'nosuchmodule'"),
    ("missing.py:forward", "cannot import 'missing.py': no such file"),
    ("mymodel:nope", "module 'mymodel' has no callable 'nope'"),
    ("mymodel:NOT_CALLABLE", "is a int, not a callable"),
    ("mymodel", "expected MODULE:CALLABLE"),
])
def test_trace_bad_target_exits_2(work: Path, target: str, message: str) -> None:
    r = run("trace", target, "-i", "8", "--json", "x.json", "--html", "x.html")
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.startswith("error: ")
    assert files(work) == {"mymodel.py"}


@pytest.mark.parametrize("spec, message", [
    ("4,a:float32", "dimension 'a' is not a non-negative integer"),
    ("4:float99", "unknown dtype 'float99'"),
    ("-1:float32", "dimension '-1'"),
])
def test_trace_bad_input_spec_exits_2(work: Path, spec: str, message: str) -> None:
    r = run("trace", "mymodel:forward", "-i", spec, "--json", "x.json")
    assert r.exit_code == 2 and message in r.output, r.output
    assert files(work) == {"mymodel.py"}


def test_a_dimension_past_mlx_shapes_exits_2(work: Path) -> None:
    r = CliRunner().invoke(main, ["trace", "mymodel:forward", "-i", "2147483648,64:float32", "-i", "8"])
    assert r.exit_code == 2 and r.stderr == ("error: bad --input '2147483648,64:float32': dimension "
                                             "2147483648 is larger than MLX takes (at most 2147483647)\n")
    assert r.exception is None or isinstance(r.exception, SystemExit)


@pytest.mark.parametrize("command", ["trace", "debug"])
@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_mlx_cannot_take_exits_2(work: Path, command: str, seed: str) -> None:
    r = CliRunner().invoke(main, [command, "mymodel:forward", "-i", "8", "-i", "8", "--seed", seed])
    assert r.exit_code == 2, r.output
    assert r.stderr == f"error: --seed {seed}: give a whole number from 0 to {2**64 - 1}\n"


def test_the_largest_seed_is_taken(work: Path) -> None:
    r = run("trace", "mymodel:forward", "-i", "8", "-i", "8", "--seed", str(2**64 - 1), "-q")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "complex64", "int32", "uint8", "bool"])
def test_random_inputs_have_the_declared_shape_dtype_and_range(dtype: str) -> None:
    import mlx.core as mx
    import numpy as np

    from graphkern.cli.commands import make_input
    from graphkern.nodes import dtype_from_name

    x = make_input((64, 32), dtype, mx.random.key(3))
    assert x.shape == (64, 32) and x.dtype == dtype_from_name(dtype)
    values = np.array(x.astype(mx.float32) if dtype == "bfloat16" else x)
    if dtype in ("float32", "bfloat16", "complex64"):  # normal: mean near 0, deviation near 1
        real = values.real
        assert abs(real.mean()) < 0.1 and 0.9 < real.std() < 1.1
        assert not np.iscomplexobj(values) or not values.imag.any()
    elif dtype == "bool":
        assert 0.4 < values.mean() < 0.6
    else:
        assert values.min() >= 0 and values.max() < 16 and len(np.unique(values)) == 16


def test_trace_missing_output_folder_exits_2_before_tracing(work: Path) -> None:
    r = run("trace", "mymodel:forward", "-i", "8", "-i", "8", "--json", "ok.json",
            "--html", "no/such/dir/g.html")
    assert r.exit_code == 2 and "does not exist" in r.output
    assert files(work) == {"mymodel.py"}


def test_nothing_written_when_a_later_output_fails(work: Path, monkeypatch) -> None:
    import graphkern.viz.dot as dot

    def no_graphviz(*a, **k):
        raise dot.DotError("rendering needs Graphviz's 'dot' program")

    monkeypatch.setattr(dot, "run_dot", no_graphviz)
    r = run("trace", "mymodel:forward", "-i", "8", "-i", "8", "--json", "g.json", "--svg", "g.svg")
    assert r.exit_code == 2 and "Graphviz" in r.output
    assert files(work) == {"mymodel.py"}


# ----------------------------------------------------------------------------- show


@pytest.fixture
def saved(tmp_path: Path) -> dict[str, Path]:
    ok, bad = tmp_path / "ok.json", tmp_path / "bad.json"
    ok.write_text(vg.traced().to_json())
    bad.write_text(vg.traced(failed=True).to_json())
    before = tmp_path / "before.json"
    before.write_text(vg.traced(kernel=False).to_json())
    return {"ok": ok, "bad": bad, "before": before}


def test_show_prints_and_converts(saved: dict[str, Path], tmp_path: Path) -> None:
    r = run("show", str(saved["ok"]), "--html", str(tmp_path / "s.html"),
            "--dot", str(tmp_path / "s.dot"), "--model-explorer", str(tmp_path / "s.me.json"))
    assert r.exit_code == 0, r.output
    assert "graph Model: 27 nodes" in r.output and "scale_add_1" in r.output
    assert "status OK" in r.output  # the per-node table's header
    assert (tmp_path / "s.html").exists() and (tmp_path / "s.dot").exists()
    r = run("show", str(saved["ok"]), "--brief")
    assert r.exit_code == 0 and "kind" not in r.output.split("\n", 3)[-1][:40]


def test_show_failed_graph_exits_1(saved: dict[str, Path]) -> None:
    r = run("show", str(saved["bad"]), "--brief")
    assert r.exit_code == 1
    assert "FAILED: scale_add_1 in layers.1: INVALID_LAUNCH" in r.output
    assert "6 nodes downstream" in r.output


@pytest.mark.parametrize("content, message", [
    ('{"schema": "graphkern.tracing.graph", "version": 1, "nodes": [', "not valid JSON"),
    ("this is not json", "not valid JSON"),
    ("", "not valid JSON"),
    ('{"hello": 1}', "not a graphkern graph"),
    ("[1, 2, 3]", "not a graphkern graph"),
])
def test_show_bad_files_exit_2(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "in.json"
    f.write_text(content)
    r = run("show", str(f), "--html", str(tmp_path / "out.html"))
    assert r.exit_code == 2 and message in r.output, r.output
    assert r.output.startswith(f"error: cannot load {f}")
    assert files(tmp_path) == {"in.json"}


def test_show_truncated_file_exits_2(saved: dict[str, Path], tmp_path: Path) -> None:
    text = saved["ok"].read_text()
    f = tmp_path / "cut.json"
    f.write_text(text[: len(text) // 2])
    r = run("show", str(f))
    assert r.exit_code == 2 and "truncated" in r.output


def test_show_unknown_schema_version_exits_2(saved: dict[str, Path], tmp_path: Path) -> None:
    doc = json.loads(saved["ok"].read_text())
    doc["version"] = 999
    f = tmp_path / "future.json"
    f.write_text(json.dumps(doc))
    r = run("show", str(f))
    assert r.exit_code == 2 and "unsupported schema version 999" in r.output


def test_show_missing_file_exits_2(tmp_path: Path) -> None:
    r = run("show", str(tmp_path / "nope.json"))
    assert r.exit_code == 2 and "cannot read" in r.output


# ----------------------------------------------------------------------------- diff and view


def test_diff_exit_status_and_outputs(saved: dict[str, Path], tmp_path: Path) -> None:
    same = run("diff", str(saved["ok"]), str(saved["ok"]))
    assert same.exit_code == 0 and "no differences" in same.output
    r = run("diff", str(saved["before"]), str(saved["ok"]), "--html", str(tmp_path / "d.html"),
            "--json", str(tmp_path / "d.json"))
    assert r.exit_code == 1
    assert "kernels: +2 added" in r.output
    assert "~ op add (Add) -> float32[4,8] replaced by kernel scale_add -> float32[4,8]" in r.output
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["kernels"]["added"] == ["scale_add", "scale_add_1"]
    assert '"diff":{"title"' in (tmp_path / "d.html").read_text()


def test_show_draws_with_the_drawing_options(saved: dict[str, Path], tmp_path: Path) -> None:
    r = run("show", str(saved["bad"]), "--brief", "--html", str(tmp_path / "g.html"),
            "--dot", str(tmp_path / "g.dot"), "--depth", "0", "--weights")
    assert r.exit_code == 1, r.output
    page = (tmp_path / "g.html").read_text()
    assert '"options":{"collapse_depth":0,"show_weights":true}' in page
    dot = (tmp_path / "g.dot").read_text()
    assert "every module closed" in dot and '"module:layers.1"' in dot


@pytest.mark.parametrize("option, name, message", [
    ("--svg", "g.gif", "the suffix .gif is not one of .svg, .png, .pdf"),
    ("--png", "g.svg", "its suffix says svg"),
])
def test_image_outputs_follow_their_suffix(saved: dict[str, Path], tmp_path: Path, option: str,
                                            name: str, message: str) -> None:
    r = run("show", str(saved["ok"]), option, str(tmp_path / name))
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / name).exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_show_renders_pdf(saved: dict[str, Path], tmp_path: Path) -> None:
    r = run("show", str(saved["ok"]), "--brief", "--pdf", str(tmp_path / "g.pdf"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "g.pdf").read_bytes()[:5] == b"%PDF-"


def test_trace_warns_when_scopes_are_lost(work: Path) -> None:
    (work / "hides.py").write_text(textwrap.dedent('''
        import mlx.nn as nn

        class Box:
            pass

        box = Box()
        box.m = nn.Linear(8, 8)

        def hidden(x):
            return getattr(box, "m")(x)

        layer = box.m

        def found(x):
            return layer(x)
    '''))
    r = run("trace", "hides.py:hidden", "-i", "8")
    assert r.exit_code == 0
    assert "warning: hidden ran the nn.Module Linear but graphkern found no module" in r.output
    r = run("trace", "hides.py:found", "-i", "8")
    assert r.exit_code == 0 and "warning" not in r.output


def test_diff_bad_file_exits_2(saved: dict[str, Path], tmp_path: Path) -> None:
    f = tmp_path / "junk.json"
    f.write_text("{")
    r = run("diff", str(saved["ok"]), str(f), "--html", str(tmp_path / "d.html"))
    assert r.exit_code == 2 and "junk.json" in r.output
    assert not (tmp_path / "d.html").exists()


def test_view_writes_the_page(saved: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "v.html"
    r = run("view", str(saved["bad"]), "--out", str(out), "--no-browser")
    assert r.exit_code == 0 and str(out) in r.output
    assert "INVALID_LAUNCH" in out.read_text()


def test_view_model_explorer_missing_says_how_to_install(saved: dict[str, Path], monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "model_explorer" else real(name, *a))
    r = run("view", str(saved["ok"]), "--model-explorer")
    assert r.exit_code == 2 and "pip install 'graphkern[model-explorer]'" in r.output


def test_view_model_explorer_starts_it(saved: dict[str, Path], monkeypatch) -> None:
    me = pytest.importorskip("model_explorer")
    seen = {}
    monkeypatch.setattr(me, "visualize_from_config", lambda **kw: seen.update(kw))
    r = run("view", str(saved["ok"]), "--model-explorer", "--no-browser", "--port", "8123")
    assert r.exit_code == 0, r.output
    assert seen["port"] == 8123 and seen["config"].model_sources[0]["url"].endswith("Model.json")


def test_written_files_have_normal_permissions(work: Path) -> None:
    r = run("trace", "mymodel:forward", "-i", "8", "-i", "8", "--json", "g.json")
    assert r.exit_code == 0
    mask = os.umask(0)
    os.umask(mask)
    assert (work / "g.json").stat().st_mode & 0o777 == 0o666 & ~mask


# ----------------------------------------------------------------------------- Ctrl-C

INTERRUPTS = textwrap.dedent('''
    import os
    import signal

    def forward(x):
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C does, while the command runs
        return x + 1
''')


@pytest.mark.parametrize("command", ["trace", "debug"])
def test_ctrl_c_exits_130_with_one_line(tmp_path: Path, command: str) -> None:
    (tmp_path / "interrupts.py").write_text(INTERRUPTS)
    r = subprocess.run([sys.executable, "-m", "graphkern", command, "interrupts.py:forward", "-i", "4"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.returncode == 130, r.stderr
    assert r.stderr.splitlines()[-1] == "interrupted (Ctrl-C)" and "Traceback" not in r.stderr


@pytest.mark.parametrize("command, module, name", [
    (["show", "g.json"], "graphkern.cli.commands", "load_graph"),
    (["diff", "g.json", "g.json"], "graphkern.cli.commands", "load_graph"),
    (["view", "g.json", "--no-browser"], "graphkern.cli.commands", "load_graph"),
    (["bench", "--model", "m"], "graphkern.cli.bench", "load_checkpoint"),
    (["demo", "--no-files"], "graphkern.demo", "run_demo"),
    (["metal-check", "rope"], "graphkern.metal_check", "check_library_metal"),
])
def test_ctrl_c_in_any_command_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         command: list[str], module: str, name: str) -> None:
    import importlib

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, command)
    assert r.exit_code == 130 and r.stderr == "interrupted (Ctrl-C)\n", r.output


def test_import_graphkern_stays_light() -> None:
    code = ("import sys, graphkern, graphkern.cli; "
            "print(sorted(m for m in ('graphkern.viz', 'graphkern.viz.html', 'graphviz', "
            "'playwright', 'rich', 'model_explorer') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
