"""One rank of the two-process tests of ``test_distributed.py``.

``python ring_worker.py SCENARIO OUT``: ``MLX_RANK`` and ``MLX_HOSTFILE`` (set by the test) make
``mx.distributed.init()`` a ring over 127.0.0.1. A scenario returns what this rank saw; it is
written to ``OUT/result<rank>.json`` (with the traceback if the scenario raised) and the test
asserts on every rank's file.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import graphkern as gk
from graphkern.models.tiny import random_model, tiny_model

TOKENS = mx.array([[3, 1, 4, 1, 5, 9]])
RUNTIME_PAUSE = 4.0  # seconds rank 0 sleeps while rank 1 attributes its run failure
#: a sparse MoE mlx-lm can shard (its experts split across ranks, the router replicated)
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
             "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "moe_intermediate_size": 64, "rms_norm_eps": 1e-5,
             "vocab_size": 128, "rope_theta": 1e6, "tie_word_embeddings": False,
             "max_position_embeddings": 512, "norm_topk_prob": True}


def build(arch: str) -> nn.Module:
    return random_model(QWEN3_MOE) if arch == "qwen3_moe" else tiny_model(arch)


def diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a - b).max().item())


def collectives(graph: gk.Graph) -> list[list[Any]]:
    return [[graph.node(n)["op"], graph.node(n)["group_size"], graph.node(n)["rank"],
             graph.node(n)["scope"]] for n in graph.nodes("collective")]


def error_facts(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None),
            "node": getattr(exc, "node", None), "status": int(getattr(exc, "status", -1)),
            "collective": getattr(exc, "collective", None), "in_step": getattr(exc, "in_step", None),
            "records": {str(k): v for k, v in (getattr(exc, "records", None) or {}).items()}}


def attempt(fn: Any) -> dict[str, Any]:
    """``fn()``'s failure as facts, or ``{"ok": True}``."""
    try:
        fn()
    except Exception as exc:
        return error_facts(exc)
    return {"ok": True}


# ----------------------------------------------------------------------------- scenarios


def models(group: Any, out: Path) -> dict[str, Any]:
    """trace, wrap, compile and patch on every rank of sharded llama, qwen3 and qwen3_moe (tensor
    parallel) and of a pipelined qwen3_moe; logits against the unsharded model."""
    rank, seen = group.rank(), {}
    for arch in ("llama", "qwen3", "qwen3_moe"):
        model = build(arch)
        ref = model(TOKENS)
        cache_ref = None
        if arch == "llama":
            cache = model.make_cache()
            model(TOKENS, cache=cache)
            cache_ref = model(mx.array([[2]]), cache=cache)
        model.shard(group)
        graph = gk.trace(model, TOKENS)
        graph.lint()
        facts: dict[str, Any] = {"collectives": collectives(graph), "graph_attrs": dict(graph.nx.graph)}
        wrapped = gk.wrap(model)
        facts["wrap"] = diff(wrapped(TOKENS), ref)
        facts["wrap_steady"] = diff(wrapped(TOKENS), ref)
        compiled = gk.compile(model)
        facts["compile"] = diff(compiled(TOKENS), ref)
        facts["compile_steady"] = diff(compiled(TOKENS), ref)
        if cache_ref is not None:
            cache = model.make_cache()
            wrapped(TOKENS, cache=cache)
            facts["cache"] = diff(wrapped(mx.array([[2]]), cache=cache), cache_ref)
            values = gk.inspect(model, TOKENS)  # its collectives run for real, on both ranks at once
            facts["inspect"] = {"values": values.nx.graph["values"], "status": int(values.status),
                                "mean": values.node("output_0")["stats"]["mean"],
                                "ref_mean": float(ref.mean().item())}
        report = gk.patch(model)
        patched = gk.wrap(model)
        facts["patched"] = diff(patched(TOKENS), ref)
        facts["patched_kernels"] = sorted({patched.graph.node(n)["kernel"] for n in patched.graph.kernels()})
        facts["patched_layers"] = sorted({p.kernel for p in report})
        patched.graph.lint()
        (out / f"{arch}_rank{rank}.json").write_text(patched.graph.to_json())
        job = gk.distributed.merge(gk.distributed.gather(patched.graph))
        job.lint()
        facts["job_nodes"] = job.nx.number_of_nodes()
        facts["job_cross_edges"] = sum(1 for *_, d in job.nx.edges(data=True) if d.get("cross_rank"))
        gk.unpatch(model)
        seen[arch] = facts
    model = build("qwen3_moe")
    ref = model(TOKENS)
    model.model.pipeline(group)
    graph = gk.trace(model, TOKENS)
    graph.lint()
    seen["pipeline"] = {"collectives": collectives(graph),
                        "peers": [graph.node(n)["peer"] for n in graph.nodes("collective")],
                        "wrap": diff(gk.wrap(model)(TOKENS), ref)}
    return seen


_INJECTED = gk.Kernel("injected", ["x"], ["out"], reference=lambda x: [x])


class InjectedNorm(nn.Module):
    """An RMSNorm that, on the rank it is given to, launches a kernel with a zero threadgroup for
    inputs of three tokens or more (an invalid launch), and is a plain RMSNorm otherwise."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[-2] >= 3:
            x = gk.launch(_INJECTED, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                          threadgroup=(0, 1, 1))[0]
        return self.norm(x)


def refusals(group: Any, out: Path) -> dict[str, Any]:
    """A failure on rank 1 only, then mismatched collective sequences: refused on every rank, and
    the group stays usable; then rank 1 stalls and rank 0's watchdog fires."""
    rank, seen = group.rank(), {}
    model = tiny_model("llama")
    short, one = mx.array([[3, 1]]), mx.array([[3]])
    ref, ref_one = model(short), model(one)
    model.shard(group)
    if rank == 1:
        layer = model.model.layers[1]
        layer.post_attention_layernorm = InjectedNorm(layer.post_attention_layernorm)
    wrapped = gk.wrap(model, timeout=60)
    seen["failure"] = attempt(lambda: wrapped(TOKENS))
    job = gk.distributed.merge(gk.distributed.gather(wrapped.graph))
    (out / f"failed_rank{rank}.json").write_text(wrapped.graph.to_json())
    if rank == 0:
        (out / "failed_job.json").write_text(job.to_json())
    seen["after_failure"] = diff(wrapped(short), ref)
    batch = mx.array([[3, 1]] * (2 + rank))  # a batch of 2 on rank 0, of 3 on rank 1
    seen["mismatch"] = attempt(lambda: wrapped(batch))
    seen["after_mismatch"] = diff(wrapped(short), ref)
    seen["mismatch_again"] = attempt(lambda: wrapped(batch))  # refused again, without exchanging
    seen["crossed_ok"] = [diff(wrapped(short), ref), diff(wrapped(one), ref_one)]  # both traced both
    seen["crossed"] = attempt(lambda: wrapped(short if rank == 0 else one))  # then call them crosswise
    seen["after_crossed"] = diff(wrapped(short), ref)

    watched = gk.compile(model, timeout=1.5)
    watched.trace(short)
    mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # both ranks traced: start together
    seen["watched"] = diff(watched(short), ref)
    if rank == 1:
        time.sleep(4.0)  # a stall: rank 0's next call waits for this rank's collectives
    started = time.monotonic()
    seen["stall"] = attempt(lambda: watched(short))
    seen["stall_seconds"] = time.monotonic() - started
    seen["after_abort"] = attempt(lambda: watched(short))
    return seen


_INVERSE = gk.Kernel("inverse", ["m"], ["out"], reference=lambda m: [mx.linalg.inv(m, stream=mx.cpu)])


class InverseProbe(nn.Module):
    """The final norm, plus a kernel that inverts a matrix: the identity on rank 0, a singular one
    on rank 1, where the run (not the trace) fails, after the model's collectives."""

    def __init__(self, norm: nn.Module, singular: bool):
        super().__init__()
        self.norm = norm
        self.matrix = mx.zeros((2, 2)) if singular else mx.eye(2)

    def __call__(self, x: mx.array) -> mx.array:
        matrix = self.matrix + 0 * x.sum()  # read after every collective of the layers
        inverse = gk.launch(_INVERSE, [matrix], [gk.OutputSpec((2, 2), mx.float32)],
                            grid=(4, 1, 1), threadgroup=(4, 1, 1))[0]
        return self.norm(x) + 0 * inverse.sum()


def runtime(group: Any, out: Path) -> dict[str, Any]:
    """A failure only the run finds, on rank 1 only, attributed there by re-running alone (the
    collectives stood in) while rank 0 sleeps; with the watchdog, rank 0 then hears of it."""
    rank, seen = group.rank(), {}
    model = tiny_model("llama")
    model.shard(group)
    model.model.norm = InverseProbe(model.model.norm, singular=rank == 1)
    wrapped = gk.wrap(model, timeout=60)
    seen["first"] = attempt(lambda: wrapped(TOKENS))
    seen["first_ended"] = time.time()
    if rank == 0:
        time.sleep(RUNTIME_PAUSE)  # a re-run that sent collectives would wait for this rank
    seen["second_started"] = time.time()
    seen["second"] = attempt(lambda: wrapped(TOKENS))
    seen["graph_status"] = int(wrapped.graph.status)
    return seen


def killed(group: Any, out: Path) -> dict[str, Any]:
    """Rank 1 is killed (SIGKILL) between two watched calls; rank 0's next call loses its ring
    connection and aborts the job."""
    rank, seen = group.rank(), {}
    double_sum = gk.compile(lambda x: mx.distributed.all_sum(x, group=group) * 2, group=group, timeout=30)
    seen["first"] = double_sum(mx.ones((4,))).tolist()
    mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # both ranks are past the first call
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    started = time.time()
    seen["second"] = attempt(lambda: double_sum(mx.ones((4,))))
    seen["second_started"], seen["second_ended"] = started, time.time()
    return seen


SCENARIOS = {"models": models, "refusals": refusals, "runtime": runtime, "killed": killed}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks before a kill
    group = mx.distributed.init()
    result: dict[str, Any] = {"rank": group.rank(), "size": group.size()}
    try:
        result.update(SCENARIOS[scenario](group, out))
    except Exception:
        result["traceback"] = traceback.format_exc()
    (out / f"result{group.rank()}.json").write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    sys.exit(1 if "traceback" in result else 0)


if __name__ == "__main__":
    main()

