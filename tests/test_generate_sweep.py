"""benchmarks/generate.py's sweep at its CPU smoke size: every architecture it measures builds, is
patched, decodes stock and patched (the kernels as their references), and agrees with stock in
float32 and is as accurate as stock in bfloat16."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import generate  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_architecture_of_the_sweep_decodes_as_stock_in_float32(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every SWEEP preset at its CPU smoke size, float32, 4-bit and 8-bit: 32 greedy tokens as
    stock's, and the first decoded token's logits within the model tolerance."""
    assert generate.main(["--sweep", "--quick", "--rounds", "1", "--tokens", "4", "--prefill", "8",
                          "--batches", "1", "--dtypes", "float32", "--sweep-bits", "4,8"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("## sweep"):].splitlines()
    rows = [line for line in table if line.startswith("| ") and "quick size" in line]
    names = [r.split(" (quick size)")[0].lstrip("| ") for r in rows]
    assert names == [name for name in generate.SWEEP for _ in ("float32", "4-bit", "8-bit")]
    header = next(line for line in table if line.startswith("| model"))
    agree = [c.strip() for c in header.split("|")].index("tokens agree")
    assert all([c.strip() for c in r.split("|")][agree] == "100%" for r in rows), rows
    agreements = [line for line in out.splitlines() if line.startswith("- greedy tokens agree")]
    assert len(agreements) == len(rows) and all("(within the model tolerance)" in a for a in agreements)


def test_every_architecture_of_the_sweep_is_as_accurate_as_stock_in_bfloat16(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same sweep in bfloat16: 16-bit rounding alone moves some random-weight models' logits
    past the model tolerance (stock's own, against the step in float32), so each patched model is
    held to at most ``NO_WORSE`` times stock's distance from that float32 step. Only the mixtures
    of experts in plain bfloat16 do not run here: MLX's CPU ``gather_mm`` takes float32 alone."""
    out_json = tmp_path / "sweep.json"
    assert generate.main(["--sweep", "--quick", "--rounds", "1", "--tokens", "2", "--prefill", "8",
                          "--batches", "1", "--dtypes", "bfloat16", "--json", str(out_json)]) == 0
    failed = [line for line in capsys.readouterr().out.splitlines() if ": failed:" in line]
    assert [f.split(" (quick size)")[0].lstrip("# ") for f in failed] == ["mixtral-8x7b", "qwen3-30b-a3b"]
    assert all("[GatherMM::eval] Currently only supports float32" in f for f in failed)
    results = json.loads(out_json.read_text())
    assert len(results) == 2 * len(generate.SWEEP) - 2
    for r in results:
        first = r["first_logits"]
        assert first["no_worse"], (r["model"], r["weights"], first)
        assert first["patched_vs_float32"] <= generate.NO_WORSE * first["stock_vs_float32"]


def test_a_breakdown_lists_the_kernels_by_their_gpu_time() -> None:
    """``--breakdown``'s kernels by name print under the per-step totals, longest first as the
    breakdown sorted them, and only the totals on the totals' line."""
    kernels = {"gk_norm_swiglu_bf16": {"us": 30.25, "launches": 16.0},
               "gemv_single": {"us": 12.5, "launches": 32.0}}
    result = {"model": "phi-3-mini", "dtype": "bfloat16", "weights": "4-bit", "rows": [],
              "breakdown": {"patched, batch 1": {"launches": 48.0, "wall_us": 910.0, "kernels": kernels}}}
    lines = generate.format_result(result).splitlines()
    at = lines.index("- per decoding step, patched, batch 1: launches 48.00, wall_us 910.00")
    assert lines[at + 1:at + 3] == ["  -     30.2 us,  16.0 launches: gk_norm_swiglu_bf16",
                                    "  -     12.5 us,  32.0 launches: gemv_single"]


def test_a_run_says_which_decoding_route_its_patched_model_chose() -> None:
    """What ``graphkern.models.route_timing`` chose is printed with the run and in the table."""
    choice = {"route": "stock", "kernels_ms": 2.855, "stock_ms": 2.724,
              "timed_calls": {"kernels": 10, "stock": 10}}
    result = {"model": "phi-3-mini", "weights": "4-bit, group 64", "weight_mb": 1000.0,
              "routes": {"b1": choice},
              "rows": [{"task": "decode b1", "stock": 400.0, "speedup": 1.0, "speedup_range": [0.99, 1.01]}]}
    assert generate.routes_line(result) == (
        "- decoding routes measured: b1: stock (kernels 2.855 ms, stock 2.724 ms a call)")
    last = generate.sweep_table([result]).splitlines()[-1]
    assert [c.strip() for c in last.split("|")][-2] == "stock"
    assert generate.routes_line({**result, "routes": {}}) == ""


def test_a_batch_mlx_lms_batch_generator_cannot_take_is_timed_through_one_kv_cache(
        tmp_path: Path) -> None:
    """mlx-lm's Gemma 2 attention cannot broadcast ``BatchGenerator``'s padding mask, stock as
    patched: its batched decoding is timed for both twins through one KV cache and the run says
    so; a Llama goes through ``BatchGenerator`` with no note. (Three rows: at as many rows as its
    KV heads the mask broadcasts, over the wrong axis, without an error.)"""
    out_json = tmp_path / "sweep.json"
    assert generate.main(["--sweep", "--quick", "--preset", "gemma-2-2b,llama-3.2-1b", "--rounds", "1",
                          "--tokens", "3", "--prefill", "8", "--batches", "1,3", "--dtypes", "float32",
                          "--sweep-bits", "", "--json", str(out_json)]) == 0
    gemma, llama = json.loads(out_json.read_text())
    for result in (gemma, llama):
        row = next(r for r in result["rows"] if r["task"] == "decode b3")
        assert row["stock"] > 0 and row["patched"] > 0 and not row["errors"], row
    assert len(gemma["notes"]) == 1 and "BatchGenerator fails on stock" in gemma["notes"][0]
    assert llama["notes"] == []
    assert f"- {gemma['notes'][0]}" in generate.format_result(gemma).splitlines()


def test_decoding_equal_prompts_through_one_kv_cache_gives_each_row_the_greedy_tokens() -> None:
    """``steps_together`` (the batch loop for models ``BatchGenerator`` cannot run) decodes each
    of its rows as ``generate_step`` decodes the prompt alone (float32, greedy, stock Gemma 2), and
    ``--breakdown`` times a step of it."""
    cfg, _ = generate.preset_config("gemma-2-2b", None, quick=True)
    stock, _ = generate.twin_models(cfg, mx.float32)
    prompt = mx.random.randint(0, cfg["vocab_size"], (8,), key=mx.random.key(3))
    alone = [int(token) for token, _ in generate.steps_b1(stock, prompt, 5)]
    rows = [token.tolist() for token in generate.steps_together(stock, prompt, 5, 3)]
    assert len(rows) == 5
    assert rows == [[token] * 3 for token in alone]
    assert generate.breakdown(generate.steps_together(stock, prompt, 5, 3))["wall_us"] > 0


def test_host_phases_take_a_decoding_step_apart_and_print_under_the_breakdown() -> None:
    """``--breakdown``'s host phases of a batch-1 step: building, handing over, waiting, each
    measured (above zero), printed one line a model."""
    cfg, _ = generate.preset_config("llama-3.2-1b", None, quick=True)
    stock, patched = generate.twin_models(cfg, mx.float32)
    prompt = mx.random.randint(0, cfg["vocab_size"], (8,), key=mx.random.key(4))
    phases = {name: generate.host_phases(model, prompt, 3)
              for name, model in (("stock", stock), ("patched", patched))}
    for found in phases.values():
        assert list(found) == ["build_us", "hand_over_us", "wait_us"] and min(found.values()) > 0
    lines = generate.format_result({"model": "m", "dtype": "float32", "weights": "float32", "rows": [],
                                    "host_phases": phases}).splitlines()
    assert [line.split(":")[0] for line in lines if "host time" in line] == [
        "- a decoding step's host time, batch 1, stock", "- a decoding step's host time, batch 1, patched"]


def test_an_odd_round_count_gets_one_more_so_each_side_leads_as_often(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Stock and patched take turns leading a round; with three rounds patched would lead two, and
    a run right after the other side's work can start slower. ``--rounds 3`` runs four, each side
    leads two, and each round's ratio is printed and kept."""
    order: list[str] = []
    real = generate.batch_decoding

    def batch_decoding(stock, prompt, batch):  # records which twin each decode run is of
        steps, note = real(stock, prompt, batch)

        def recorded(model, *args):
            order.append("stock" if model is stock else "patched")
            return steps(model, *args)
        return recorded, note

    monkeypatch.setattr(generate, "batch_decoding", batch_decoding)
    out_json = tmp_path / "run.json"
    assert generate.main(["--sizes", "tiny", "--models", "llama", "--dtypes", "float32", "--modes", "eager",
                          "--batches", "1", "--prefill", "8", "--tokens", "3", "--rounds", "3",
                          "--json", str(out_json)]) == 0
    decode = next(r for r in json.loads(out_json.read_text())[0]["rows"] if r["task"] == "decode b1")
    assert len(decode["speedup_rounds"]) == 4
    assert min(decode["speedup_rounds"]) == decode["speedup_range"][0]
    assert len(order) == 2 * 5  # the warm-up round and four timed ones
    leaders = order[2::2]
    assert leaders == ["patched", "stock", "patched", "stock"], order
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| decode b1"))
    assert line.rstrip(" |").endswith(", ".join(f"{r:.3f}" for r in decode["speedup_rounds"]))


def test_a_twin_is_timed_in_the_same_rounds_as_two_identical_models(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--twin``: a second, unpatched model object holding stock's very weight arrays takes part
    in every round, leading the rounds patched does not; its rows give twin over stock per round,
    beside the patched rows, and the sweep's table gives them columns of their own."""
    from mlx.utils import tree_flatten

    from graphkern.models.layers.base import KernelLayer

    calls: list[tuple[str, Any]] = []
    real = generate.batch_decoding

    def batch_decoding(stock, prompt, batch):  # records which model each decode run is of
        steps, note = real(stock, prompt, batch)

        def recorded(model, *args):
            patched = any(isinstance(m, KernelLayer) for _, m in model.named_modules())
            calls.append(("stock" if model is stock else "patched" if patched else "twin", model))
            return steps(model, *args)
        return recorded, note

    monkeypatch.setattr(generate, "batch_decoding", batch_decoding)
    out_json = tmp_path / "run.json"
    assert generate.main(["--sizes", "tiny", "--models", "llama", "--dtypes", "float32", "--modes", "eager",
                          "--batches", "1", "--prefill", "8", "--tokens", "3", "--rounds", "1", "--twin",
                          "--json", str(out_json)]) == 0
    names = [name for name, _ in calls]
    assert len(names) == 3 * 3  # the warm-up round and two timed ones, three models each
    assert [names[i] for i in (3, 6)] == ["patched", "twin"], names
    models = {name: model for name, model in calls}
    stock, twin = (tree_flatten(models[n].parameters()) for n in ("stock", "twin"))
    assert [k for k, _ in twin] == [k for k, _ in stock]
    assert all(a is b for (_, a), (_, b) in zip(twin, stock))
    rows = json.loads(out_json.read_text())[0]["rows"]
    twins = [r for r in rows if r["mode"] == "twin"]
    assert [r["task"] for r in twins] == [r["task"] for r in rows if r["mode"] == "eager"]
    assert all(len(r["speedup_rounds"]) == 2 and r["stock"] > 0 and r["patched"] > 0 for r in twins)
    header = generate.sweep_table([{"model": "m", "weights": "float32", "rows": rows}]).splitlines()[2]
    assert "decode b1 twin" in header and "| decode b1 |" in header


def test_without_and_with_change_the_patched_models_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    """The default patch decodes a quantized model's blocks without the opt-in ``quantized_matvec``;
    ``--with quantized_matvec`` adds it, ``--without`` leaves a default kernel out; the header says
    both, and a name no patch rule uses is refused by name."""
    cfg = generate.preset_config("llama-3.2-1b", None, True)[0]
    _, default = generate.twin_models(cfg, mx.float32, bits=4)
    block = default.model.layers[0]
    assert "quantized_matvec" not in block._gk_decoding and "quantized_norm_swiglu" in block._gk_decoding
    _, extra = generate.twin_models(cfg, mx.float32, bits=4, extra=["quantized_matvec"])
    assert "quantized_matvec" in extra.model.layers[0]._gk_decoding
    _, fewer = generate.twin_models(cfg, mx.float32, bits=4, without=["quantized_norm_swiglu"])
    assert "quantized_norm_swiglu" not in fewer.model.layers[0]._gk_decoding
    assert generate.main(["--sizes", "tiny", "--models", "llama", "--dtypes", "float32", "--modes", "eager",
                          "--batches", "1", "--prefill", "8", "--tokens", "2", "--rounds", "1",
                          "--without", "swiglu", "--with", "quantized_matvec"]) == 0
    assert "; patched without swiglu; patched with quantized_matvec" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        generate.main(["--sizes", "tiny", "--with", "no_such_kernel"])
    assert "unknown kernels ['no_such_kernel']" in capsys.readouterr().err


def test_a_route_given_is_the_patched_models_and_the_header_says_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--route kernel``: the patched model's layers take that route (for measuring what the
    route measurement did not choose), and the header says so."""
    _, patched = generate.twin_models(generate.preset_config("llama-3.2-1b", None, True)[0], mx.float32,
                                      route="kernel")
    assert {layer._gk_call_route for layer in patched.model.layers} == {"kernel"}
    assert generate.main(["--sizes", "tiny", "--models", "llama", "--dtypes", "float32", "--modes", "eager",
                          "--batches", "1", "--prefill", "8", "--tokens", "2", "--rounds", "1",
                          "--route", "stock"]) == 0
    assert "; patched on the stock route" in capsys.readouterr().out
