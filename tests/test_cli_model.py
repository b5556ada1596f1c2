"""The command line on mlx-lm checkpoint folders: ``--model PATH``, ``--prompt`` and ``--patch`` for
trace, debug and view, and ``bench``; on a float32 folder and a 4-bit one from mlx-lm's converter,
both written offline by ``graphkern.models.checkpoint``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from graphkern.cli import main
from graphkern.cli.model import load_checkpoint, prompt_tokens
from graphkern.models.checkpoint import write_checkpoint
from graphkern.models.generation_bench import GenerationResult, GenerationRun
from graphkern.nodes import KernelError

pytest.importorskip("mlx_lm")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("checkpoints")
    return {"float": str(write_checkpoint(base / "tiny-llama")),
            "4bit": str(write_checkpoint(base / "tiny-llama-4bit", quantize=4))}


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


# ----------------------------------------------------------------------------- the folders


def test_the_folders_load_with_mlx_lm_and_the_4bit_one_is_quantized(folders: dict[str, str]) -> None:
    import mlx_lm

    names = set(os.listdir(folders["4bit"]))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads(Path(folders["4bit"], "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    model, tokenizer = mlx_lm.load(folders["4bit"])
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    float_model, _ = mlx_lm.load(folders["float"])
    assert type(float_model.model.layers[0].mlp.down_proj).__name__ == "Linear"
    assert tokenizer.has_chat_template
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=3) is not None


def test_write_checkpoint_refuses_an_existing_folder_and_unknown_arguments(tmp_path: Path) -> None:
    with pytest.raises(KernelError, match="already exists"):
        write_checkpoint(tmp_path)
    with pytest.raises(KernelError, match="unknown architecture 'gpt9'"):
        write_checkpoint(tmp_path / "a", "gpt9")
    with pytest.raises(KernelError, match="quantize must be None, 4 or 8"):
        write_checkpoint(tmp_path / "b", quantize=3)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_write_checkpoint_takes_a_real_models_sizes(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "deeper", config={"num_hidden_layers": 3, "intermediate_size": 192})
    ckpt = load_checkpoint(str(folder))
    assert ckpt.describe() == "deeper (llama, 3 layers, float32)"
    assert len(ckpt.model.model.layers) == 3
    assert ckpt.model.model.layers[0].mlp.gate_proj.weight.shape == (192, 64)


def test_the_prompt_goes_through_the_chat_template(folders: dict[str, str]) -> None:
    ckpt = load_checkpoint(folders["float"])
    tokens = prompt_tokens(ckpt.tokenizer, "hi there")
    text = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}],
                                              tokenize=False, add_generation_prompt=True)
    assert text == "<|user|> hi there <|assistant|>"
    assert tokens.dtype == mx.int32 and tokens.shape == (1, 4)
    assert tokens[0].tolist() == ckpt.tokenizer.encode(text, add_special_tokens=False)
    assert ckpt.describe() == "tiny-llama (llama, 2 layers, float32)"
    assert load_checkpoint(folders["4bit"]).describe() == "tiny-llama-4bit (llama, 2 layers, 4-bit)"


def test_without_a_chat_template_the_prompt_is_encoded_with_special_tokens(folders: dict[str, str],
                                                                           tmp_path: Path) -> None:
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(folders["float"], plain)
    (plain / "chat_template.jinja").unlink()
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(str(plain))
    assert not ckpt.tokenizer.has_chat_template
    tokens = prompt_tokens(ckpt.tokenizer, "hi there")[0].tolist()
    assert tokens == ckpt.tokenizer.encode("hi there", add_special_tokens=True)
    assert ckpt.tokenizer.convert_ids_to_tokens(tokens)[-2:] == ["hi", "there"]


# ----------------------------------------------------------------------------- trace, debug, view


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_trace_a_checkpoint_folder(folders: dict[str, str], kind: str, tmp_path: Path) -> None:
    code, out, err = run("trace", "--model", folders[kind], "--prompt", "hi there",
                         "--json", str(tmp_path / "g.json"), "--html", str(tmp_path / "g.html"))
    assert code == 0, err
    name = Path(folders[kind]).name
    assert out.startswith(f"graph {name}: ") and "status: OK" in out
    assert "prompt 4 tokens" in err
    graph = json.loads((tmp_path / "g.json").read_text())
    scopes = {n.get("scope") for n in graph["nodes"]}
    assert "model.layers.1.mlp" in scopes
    assert (tmp_path / "g.html").stat().st_size > 10_000


#: What patch reports of the tiny checkpoints, float or quantized: the quantized one's embedding and
#: output layer stay stock (their product kernel, ``quantized_matvec``, is opt-in).
PATCHED = {"float": "patched 7 layers: add_rms_norm 3, rope_qk 2, swiglu 2",
           "4bit": "patched 7 layers: add_rms_norm 3, rope_qk 2, swiglu 2"}


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_trace_a_patched_checkpoint_shows_its_kernels_under_the_users_classes(
        folders: dict[str, str], kind: str, tmp_path: Path) -> None:
    code, out, err = run("trace", "--model", folders[kind], "--patch", "--json", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "kernels: gk_add_rms_norm" in out and "gk_rope_qk" in out
    assert PATCHED[kind] in err
    # in words, and why the trace shows fused kernels the patch did not name
    assert re.search(r"^  add_rms_norm +a residual add and the RMSNorm after it$", err, re.M)
    assert re.search(r"^  swiglu +an MLP's silu\(gate\) \* up$", err, re.M)
    assert "a trace then shows gk_norm_projections and gk_norm_swiglu (or gk_quantized_*)" in err
    fused = "gk_quantized_norm_swiglu" if kind == "4bit" else "gk_norm_swiglu"
    assert "kernels: gk_add_rms_norm, " in out and fused in out
    assert f"  {fused}" in out and "an MLP's" in out.split(f"  {fused}")[1].splitlines()[0]
    modules = json.loads((tmp_path / "p.json").read_text())["graph"]["modules"]
    assert modules["model"] == "LlamaModel" and modules["model.layers.0"] == "TransformerBlock"
    assert not any(cls.startswith("Kernel") for cls in modules.values())


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_debug_a_checkpoint_folder(folders: dict[str, str], kind: str) -> None:
    code, out, err = run("debug", "--model", folders[kind], "--prompt", "hi")
    assert code == 0, err
    name = Path(folders[kind]).name
    assert out.splitlines()[0].startswith(f"{name}: ") and "all values finite" in out


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_debug_compares_a_patched_checkpoint_with_its_stock_model(folders: dict[str, str], kind: str,
                                                                 tmp_path: Path) -> None:
    code, out, err = run("debug", "--model", folders[kind], "--patch", "--compare-stock",
                         "--html", str(tmp_path / "c.html"))
    assert code == 0, out + err
    name = Path(folders[kind]).name
    assert f"compare a = {name} stock with b = {name} patched (kernels as their pure-MLX references)" in out
    assert "no divergence" in out
    assert (tmp_path / "c.html").exists()


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_view_a_checkpoint_folder(folders: dict[str, str], kind: str, tmp_path: Path) -> None:
    page = tmp_path / "v.html"
    code, out, err = run("view", "--model", folders[kind], "--patch", "--out", str(page), "--no-browser")
    assert code == 0, err
    assert out.strip() == f"wrote {page}"
    html = page.read_text()
    assert "gk_rope_qk" in html and "TransformerBlock" in html and "KernelResidualBlock" not in html


# ----------------------------------------------------------------------------- bench


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_bench_prints_stock_and_patched_runs_and_the_median_ratio(folders: dict[str, str], kind: str) -> None:
    code, out, err = run("bench", "--model", folders[kind], "--max-tokens", "5", "--rounds", "2")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"model {Path(folders[kind]).name} (llama, 2 layers, ")
    assert "5 generated tokens, 2 rounds after a warm-up run of 4 each" in lines[0]
    assert lines[1].startswith(PATCHED[kind])
    runs = [line for line in lines if line.startswith("round ")]
    assert [r.split()[:3] for r in runs] == [["round", "1", "stock"], ["round", "1", "patched"],
                                               ["round", "2", "patched"], ["round", "2", "stock"]]
    assert all("Generation: 5 tokens, " in r and "tokens-per-sec" in r and "Peak memory: " in r for r in runs)
    assert "first round: 5 of 5 the same in both" in out  # exact on a CPU
    assert lines[-1].startswith("patched / stock, median of 2 rounds of 5 tokens: prompt ")
    # progress on stderr, as it happens: the warm-up, then how long the rounds will take
    notes = err.splitlines()
    assert notes[0].startswith("warm-up: a run of 4 tokens each")
    assert notes[1].startswith("warm-up: stock ")
    assert "2 rounds of 5 tokens a run should take about " in notes[1]
    assert notes[2].startswith("round 1 took ") and "1 more round: about " in notes[2]


def test_bench_chooses_its_tokens_to_take_about_a_minute(folders: dict[str, str]) -> None:
    """Without --max-tokens: as many as fit the minute at the stock warm-up's pace (on a tiny
    model, the most)."""
    from graphkern.models.generation_bench import AUTO_TOKENS

    code, out, err = run("bench", "--model", folders["4bit"], "--rounds", "1")
    assert code == 0, err
    assert "about a minute's worth of generated tokens, 1 round after" in out
    assert f"1 round of {AUTO_TOKENS[1]} tokens a run should take about" in err
    assert out.splitlines()[-1].startswith(f"patched / stock, median of 1 round of {AUTO_TOKENS[1]} tokens")


def test_the_tokens_a_run_makes_fit_the_time_left_within_bounds() -> None:
    from graphkern.models.generation_bench import _tokens_for

    assert _tokens_for(50.0, 0.5, 2) == 24  # 50 s for 4 runs at 2 tokens a second: 25 steps, a prompt
    assert _tokens_for(50.0, 5.0, 2) == 8   # a slow machine still measures 8 tokens
    assert _tokens_for(50.0, 0.001, 2) == 128
    assert _tokens_for(-3.0, 0.5, 2) == 8   # the warm-up took the whole minute


def test_bench_measures_and_reports_each_run_as_it_ends(folders: dict[str, str]) -> None:
    """The runs' lines come out one by one (not all at the end), each before the next run starts;
    stock leads the first round and patched the second."""
    from graphkern.models.generation_bench import RunDone, measure_generation

    ckpt = load_checkpoint(folders["float"])
    seen: list[str] = []
    plans = []

    def on_run(done: RunDone) -> None:
        seen.append(f"{done.round} {done.side} {done.run.generation_tokens} {done.seconds > 0}")

    result = measure_generation(ckpt.model, ckpt.twin(), ckpt.tokenizer, [1, 2, 3], max_tokens=6, rounds=2,
                                progress=lambda text: seen.append(text), on_run=on_run, on_plan=plans.append,
                                on_token=lambda: seen.append("t"))
    compact = [s for s in seen if s != "t"]
    assert compact == ["warm-up: stock", "0 stock 4 True", "warm-up: patched", "0 patched 4 True",
                       "round 1 of 2: stock", "1 stock 6 True", "round 1 of 2: patched", "1 patched 6 True",
                       "round 2 of 2: patched", "2 patched 6 True", "round 2 of 2: stock", "2 stock 6 True"]
    assert seen.count("t") == 2 * 4 + 4 * 6
    assert len(plans) == 1 and plans[0].max_tokens == 6 and plans[0].estimate > 0
    assert result.max_tokens == 6 and len(result.rounds) == 2


@pytest.mark.slow
def test_ctrl_c_during_bench_exits_130_with_one_line(folders: dict[str, str]) -> None:
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "graphkern", "bench", "--model", folders["4bit"],
                             "--max-tokens", "100000"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = ""
        while "should take about" not in line:  # generating the rounds
            line = proc.stderr.readline()
            assert line, "bench ended before its rounds"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err == "interrupted (Ctrl-C)\n"


def test_the_ratio_is_the_median_of_per_round_ratios() -> None:
    def runs(stock_tps: float, patched_tps: float) -> dict[str, GenerationRun]:
        return {side: GenerationRun(3, 100.0, 5, tps, 1.0, (1, 2)) for side, tps in
                (("stock", stock_tps), ("patched", patched_tps))}

    result = GenerationResult([runs(100, 110), runs(200, 180), runs(50, 100)])
    assert result.ratio("generation_tps") == pytest.approx(1.1)  # of 1.1, 0.9 and 2.0
    assert result.ratio("peak_memory") == 1.0
    assert result.same_tokens() == (2, 2)
    one = GenerationRun(1, 50.0, 1, 20.0, 0.5, (7,)).verbose_line()
    assert one.startswith("Prompt: 1 token, 50.000 tokens-per-sec  Generation: 1 token, 20.000 ")


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def no_tokenizer(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The float checkpoint without its tokenizer files (weights and config only)."""
    import shutil

    folder = tmp_path_factory.mktemp("bare") / "tiny-llama-bare"
    shutil.copytree(folders["float"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["trace", "debug", "view", "bench"])
def test_a_folder_without_a_tokenizer_says_so_and_how_to_run_without_a_prompt(no_tokenizer: str,
                                                                              command: str) -> None:
    """Not transformers' lines about sentencepiece and tiktoken: what is missing, and --tokens."""
    proc = subprocess.run([sys.executable, "-m", "graphkern", command, "--model", no_tokenizer],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: --model {no_tokenizer}: the folder has no tokenizer "
                               "(no tokenizer.json or tokenizer.model), so a prompt cannot be turned "
                               "into tokens; ")
    assert "sentencepiece" not in proc.stderr and "tiktoken" not in proc.stderr
    if command == "bench":
        assert "--tokens" not in lines[0] and "bench generates text" in lines[0]
    else:
        assert lines[0].endswith("run the model on token ids instead of a prompt: --tokens 1,2,3")


def test_token_ids_run_a_folder_without_a_tokenizer(no_tokenizer: str, tmp_path: Path) -> None:
    code, out, err = run("trace", "--model", no_tokenizer, "--tokens", "1,2,3",
                         "--json", str(tmp_path / "g.json"))
    assert code == 0, err
    assert "status: OK" in out and "prompt 3 tokens" in err
    code, out, err = run("debug", "--model", no_tokenizer, "--tokens", "5", "--patch", "--compare-stock")
    assert code == 0, out + err
    assert "prompt 1 token\n" in err and "no divergence" in out
    page = tmp_path / "v.html"
    code, out, err = run("view", "--model", no_tokenizer, "--tokens", "4 5", "--out", str(page),
                         "--no-browser")
    assert code == 0 and page.exists(), err


def test_token_ids_give_the_same_graph_as_the_prompt_they_come_from(folders: dict[str, str],
                                                                    tmp_path: Path) -> None:
    ckpt = load_checkpoint(folders["float"])
    ids = ",".join(str(i) for i in prompt_tokens(ckpt.tokenizer, "hi there")[0].tolist())
    code, by_prompt, _ = run("debug", "--model", folders["float"], "--prompt", "hi there", "-q",
                             "--json", str(tmp_path / "p.json"))
    code2, by_ids, _ = run("debug", "--model", folders["float"], "--tokens", ids, "-q",
                           "--json", str(tmp_path / "t.json"))
    assert code == code2 == 0
    stats = [json.loads((tmp_path / name).read_text())["nodes"] for name in ("p.json", "t.json")]
    assert [n.get("stats") for n in stats[0]] == [n.get("stats") for n in stats[1]]


@pytest.mark.parametrize("tokens, message", [
    ("1,x", "--tokens 1,x: give token ids as integers separated by commas, e.g. 1,2,3"),
    (",", "--tokens ',': give at least one token id"),
    ("1,128", "--tokens 1,128 with --model "),
    ("-1", "--tokens -1 with --model "),
])
def test_bad_token_ids_exit_2(folders: dict[str, str], tokens: str, message: str) -> None:
    code, _, err = run("trace", "--model", folders["float"], "--tokens", tokens)
    assert code == 2 and err.startswith("error: " + message), err


def test_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    code, _, err = run("trace", "--model", str(tmp_path / "nowhere"))
    assert code == 2
    assert err.startswith(f"error: --model {tmp_path / 'nowhere'}: no such folder (give an mlx-lm checkpoint")


def test_a_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    code, _, err = run("debug", "--model", str(tmp_path))
    assert code == 2 and "no config.json in the folder" in err


def test_a_symlink_loop_says_so(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    code, _, err = run("trace", "--model", str(tmp_path / "a"))
    assert code == 2
    assert err == (f"error: --model {tmp_path / 'a'}: a symlink loop (its links lead back to themselves, "
                   "never to a folder)\n")


def deny_reading(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """``os.access`` says this user may not read ``path`` (the tests run as root, who reads anything)."""
    real_access = os.access

    def access(target: str, mode: int, **kw: object) -> bool:
        if os.fspath(target) == str(path) and mode & os.R_OK:
            return False
        return real_access(target, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)


def test_a_folder_that_cannot_be_read_says_so(folders: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    deny_reading(monkeypatch, Path(folders["float"]))
    code, _, err = run("debug", "--model", folders["float"])
    assert code == 2
    assert err == f"error: --model {folders['float']}: the folder cannot be read: permission denied\n"


def test_a_config_that_cannot_be_read_says_so(folders: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    deny_reading(monkeypatch, Path(folders["float"], "config.json"))
    code, _, err = run("bench", "--model", folders["float"])
    assert code == 2
    assert err == f"error: --model {folders['float']}: its config.json cannot be read: permission denied\n"


def test_a_folder_behind_one_that_cannot_be_searched_says_so(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    hidden, real_stat = tmp_path / "theirs" / "ck", os.stat

    def stat(path: str, *args: object, **kw: object) -> os.stat_result:
        if os.fspath(path) == str(hidden):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_stat(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    code, _, err = run("trace", "--model", str(hidden))
    assert code == 2 and err == f"error: --model {hidden}: cannot be read: permission denied\n"


@pytest.mark.parametrize("function", ["patch", "unpatch", "patched_layers"])
def test_patching_what_is_not_a_module_is_a_model_error(function: str) -> None:
    import graphkern as gk
    from graphkern.models import patched_layers

    call = patched_layers if function == "patched_layers" else getattr(gk, function)
    with pytest.raises(gk.ModelError, match=f"{function} takes an mlx.nn.Module and got None"):
        call(None)
    with pytest.raises(gk.ModelError, match=f"{function} takes an mlx.nn.Module and got builtins.dict"):
        call({"layer": 1})


@pytest.mark.slow
def test_an_unreachable_hub_id_says_so() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "graphkern", "bench", "--model", "nobody/no-such-model"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --model nobody/no-such-model: no such folder, and it could not be "
                                  "downloaded from the Hugging Face Hub (")


@pytest.fixture(scope="module")
def mismatched(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The float checkpoint with a tokenizer that knows a word whose id is far past the model's
    128 embedding rows."""
    import shutil

    folder = tmp_path_factory.mktemp("mismatched") / "tiny-llama"
    shutil.copytree(folders["float"], folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zebra"] = 2_000_000_000
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["debug", "bench", "trace"])
def test_a_token_id_past_the_embedding_exits_2_before_the_model_runs(mismatched: str, command: str) -> None:
    """MLX's gather does not check its indices: the process died of SIGSEGV (in a subprocess here
    so that a crash fails the test, not the test run)."""
    proc = subprocess.run([sys.executable, "-m", "graphkern", command, "--model", mismatched,
                           "--prompt", "hi zebra"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (f"error: --prompt 'hi zebra' with --model {mismatched}: token id 2000000000 is "
                           "past the 128 rows of the model's token embedding (does the tokenizer belong "
                           "to these weights?)\n")


def test_measure_generation_checks_the_prompt_against_the_embedding(folders: dict[str, str]) -> None:
    from graphkern.errors import ModelError
    from graphkern.models.generation_bench import measure_generation

    ckpt = load_checkpoint(folders["float"])
    with pytest.raises(ModelError, match="token id 128 is past the 128 rows of the model's token embedding"):
        measure_generation(ckpt.model, ckpt.model, ckpt.tokenizer, [1, 128], max_tokens=2, rounds=1)
    with pytest.raises(ModelError, match="token id -1 is negative"):
        measure_generation(ckpt.model, ckpt.model, ckpt.tokenizer, [-1, 5], max_tokens=2, rounds=1)


NOT_UTF8 = "error: --prompt: not UTF-8 text (byte 0xff at character 3); give the text in UTF-8\n"


@pytest.mark.slow
def test_a_prompt_that_is_not_utf8_exits_2(folders: dict[str, str]) -> None:
    """The shell hands Python the bytes of an argument that is not UTF-8 as lone surrogates."""
    proc = subprocess.run([sys.executable, "-m", "graphkern", "debug", "--model", folders["float"],
                           "--prompt", b"hi \xff there"], capture_output=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.decode() == NOT_UTF8


@pytest.mark.parametrize("command", ["trace", "debug", "view", "bench"])
def test_every_command_with_a_prompt_refuses_one_that_is_not_utf8(folders: dict[str, str],
                                                                  command: str) -> None:
    result = CliRunner().invoke(main, [command, "--model", folders["float"], "--prompt", "hi \udcff there"])
    assert result.exit_code == 2 and result.stderr == NOT_UTF8, result.output


@pytest.mark.parametrize("args, message", [
    (["trace"], "give MODULE:CALLABLE (a .py file or module and a callable in it, with -i"),
    (["view"], "give FILE.json (a graph written by --json) or --model PATH"),
    (["trace", "x.py:f", "--model", "m"], "give either MODULE:CALLABLE or --model PATH, not both"),
    (["trace", "--prompt", "hi", "x.py:f"], "--prompt goes with --model PATH"),
    (["debug", "--patch", "x.py:f"], "--patch goes with --model PATH"),
    (["trace", "--model", "m", "-i", "1,4:int32"],
     "-i/--input is for MODULE:CALLABLE; with --model the input"),
    (["debug", "--model", "m", "--compare-stock"], "--compare-stock compares a patched checkpoint"),
    (["trace", "--tokens", "1,2", "x.py:f"], "--tokens goes with --model PATH"),
    (["trace", "--model", "m", "--tokens", "1", "--prompt", "hi"],
     "give either --prompt TEXT or --tokens IDS"),
])
def test_options_that_do_not_go_together(args: list[str], message: str) -> None:
    code, _, err = run(*args)
    assert code == 2 and message in err, err
