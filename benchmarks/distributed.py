"""A tensor-parallel llama on two ranks over MLX's ring backend (loopback, CPU).

Run: python benchmarks/distributed.py [--hidden 256 --layers 4 --length 32 --rounds 15 --number 20]

It launches itself on two local ranks over 127.0.0.1 (``graphkern.distributed.launcher``; under
``mlx.launch -n 2 --backend ring`` it is one of the ranks) and rank 0 prints, for both ranks:

1. a steady call of the sharded model (evaluated): hand-written ``mx.compile`` of the sharded model,
   ``gk.compile``, ``gk.wrap``, and ``gk.wrap(timeout=60)`` (the watchdog: a watched call waits for
   its outputs, enters the flight record and first checks that every rank runs the same
   collectives), timed in alternation, with each one's median ratio to ``mx.compile`` over the
   rounds (target for the steady call: <= 1.02), in wall time and in the calling thread's CPU
   time (what graphkern adds runs there; on a busy machine the wall time of a ring collective
   varies by milliseconds), and the bytes each call receives over the ring (the same for the
   unwatched sides: graphkern adds no collective; the watched side adds its check's);
2. what agreeing on a new signature costs: one agreement (every rank's status and collective
   fingerprint in one ``all_gather``) next to a bare ``all_sum`` of one float, and the first call of
   a new signature through ``gk.wrap`` (trace, agreement, compile, run) next to a fresh
   ``mx.compile``'s first call (compile, run);
3. what a watched call's per-call check costs: one ``check_step`` (every rank's collective
   fingerprint in one ``all_gather``) next to a bare ``all_sum`` of one float, its bytes, and its
   share of the watched steady call.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import forward_arguments, header, interleaved_samples, paired_ratio, summary  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.distributed.agreement import StepCheck, agree, check_step, gather_bytes  # noqa: E402
from graphkern.distributed.launcher import run_ranks  # noqa: E402
from graphkern.distributed.sync import describe_call  # noqa: E402
from graphkern.distributed.watchdog import ring_connections  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, random_model  # noqa: E402


def arguments() -> Any:
    parser = forward_arguments(batch=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--agreements", type=int, default=200)
    return parser.parse_args()


def launch() -> None:
    """Run this script on two local ranks and print what rank 0 printed."""
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    runs = run_ranks([sys.executable, __file__, *sys.argv[1:]], 2, timeout=3600, env=env)
    failed = [run for run in runs if run.returncode != 0]
    for run in failed or runs[:1]:
        if failed:
            print(f"--- rank {run.rank} (exit {run.returncode})")
        print("\n".join(line for line in run.output.splitlines() if not line.startswith("[ring] ")))
    sys.exit(1 if failed else 0)


def ring_bytes() -> int | None:
    """Bytes this process has received over its ring connections (Linux's TCP_INFO
    ``tcpi_bytes_received``), or None where that cannot be read."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    total = 0
    for sock in ring_connections():
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < 136:
            return None
        total += struct.unpack_from("<Q", info, 128)[0]
    return total


def bytes_per_call(fn: Any, calls: int, group: Any) -> int | None:
    """Ring bytes received per call of ``fn`` (both ranks make the same calls), rounded. Each rank
    reads its count before a barrier (an ``all_sum`` of one float, a few bytes) that opens the
    window and after one that closes it, so no rank's calls reach the other outside its window."""
    def barrier() -> None:
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=group))

    before = ring_bytes()
    barrier()
    for _ in range(calls):
        fn()
    barrier()
    after = ring_bytes()
    return None if before is None or after is None else round((after - before) / calls)


def rank_main(args: Any) -> None:
    group = mx.distributed.init()
    rank = group.rank()
    config = {**TINY_CONFIGS["llama"], "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "intermediate_size": 2 * args.hidden, "num_attention_heads": 8, "num_key_value_heads": 4,
              "vocab_size": 512}
    model = random_model(config)
    tokens = mx.random.randint(0, 512, (args.batch, args.length), key=mx.random.key(0))
    reference = model(tokens)
    model.shard(group)
    by_hand = mx.compile(model, inputs=model.state)
    compiled, wrapped = gk.compile(model), gk.wrap(model)
    watched = gk.wrap(model, timeout=60)
    for fn in (by_hand, compiled, wrapped, watched):
        assert mx.allclose(fn(tokens), reference, atol=1e-4).item()
    sides = {
        "mx.compile": lambda: mx.eval(by_hand(tokens)),
        "gk.compile": lambda: mx.eval(compiled(tokens)),
        "gk.wrap": lambda: mx.eval(wrapped(tokens)),
        "gk.wrap(timeout=60)": lambda: mx.eval(watched(tokens)),
    }
    samples = interleaved_samples(sides, rounds=args.rounds, number=args.number, shuffle=True)
    cpu = interleaved_samples(sides, rounds=args.rounds, number=args.number, shuffle=True,
                              clock=time.thread_time)
    steady = {name: {**stats, "ratio": paired_ratio(samples, name, "mx.compile"),
                     "cpu": statistics.median(cpu[name]),
                     "cpu_ratio": paired_ratio(cpu, name, "mx.compile"),
                     "bytes": bytes_per_call(sides[name], 20, group)}
              for name, stats in summary(samples).items()}

    graph = wrapped.graph
    what = describe_call("Model", [tokens])
    one = mx.ones((1,))
    agreement = interleaved_samples({
        "agreement": lambda: agree(group, graph, None, what),
        "all_sum of 1 float": lambda: mx.eval(mx.distributed.all_sum(one, group=group)),
    }, rounds=args.rounds, number=args.agreements)
    costs = {name: statistics.median(v) for name, v in agreement.items()}
    costs_bytes = bytes_per_call(lambda: agree(group, graph, None, what), 20, group)
    step = StepCheck(rank, graph)
    checks = interleaved_samples({
        "check_step": lambda: check_step(group, step, what),
        "all_sum of 1 float": lambda: mx.eval(mx.distributed.all_sum(one, group=group)),
    }, rounds=args.rounds, number=args.agreements)
    check = {name: statistics.median(v) for name, v in checks.items()}
    check_bytes = bytes_per_call(lambda: check_step(group, step, what), 20, group)
    first: dict[str, float] = {}
    sides = [("mx.compile", lambda: mx.compile(model, inputs=model.state)),
             ("gk.wrap", lambda: gk.wrap(model))]
    for length in (args.length + 1, args.length + 2):  # two new signatures, the sides in turn
        fresh = mx.random.randint(0, 512, (args.batch, length), key=mx.random.key(length))
        sides.reverse()
        for name, make in sides:
            fn = make()
            mx.eval(mx.distributed.all_sum(one, group=group))  # start together
            start = time.perf_counter()
            mx.eval(fn(fresh))
            first[name] = first.get(name, 0.0) + (time.perf_counter() - start) / 2
    mine = {"steady": steady, "agreement": costs, "agreement_bytes": costs_bytes, "first": first,
            "check": check, "check_bytes": check_bytes}
    reports = [json.loads(b) for b in gather_bytes(group, json.dumps(mine).encode())]
    if rank == 0:
        report(args, reports)


def report(args: Any, reports: list[dict[str, Any]]) -> None:
    print(header(f"sharded llama on 2 ranks (ring, loopback): hidden {args.hidden}, {args.layers} layers, "
                 f"tokens {args.batch}x{args.length}, {args.rounds} rounds of {args.number} calls"))
    print("\nsteady call (evaluated), wall time: median us/call [min-max], median paired ratio to "
          "mx.compile")
    for name in reports[0]["steady"]:
        cells = []
        for r, rep in enumerate(reports):
            s = rep["steady"][name]
            cells.append(f"rank {r}: {s['median'] * 1e6:8.1f} [{s['min'] * 1e6:.1f}-{s['max'] * 1e6:.1f}]"
                         f" x{s['ratio']:.3f}")
        print(f"{name:>20}  " + "   ".join(cells))
    print("\nsteady call, the calling thread's CPU time (Python, graph building, scheduling; MLX's own "
          "threads run the ops): median us/call, paired ratio, difference to mx.compile")
    for name in reports[0]["steady"]:
        cells = []
        for r, rep in enumerate(reports):
            s, base = rep["steady"][name], rep["steady"]["mx.compile"]
            cells.append(f"rank {r}: {s['cpu'] * 1e6:8.1f} x{s['cpu_ratio']:.3f} "
                         f"{(s['cpu'] - base['cpu']) * 1e6:+7.1f}")
        print(f"{name:>20}  " + "   ".join(cells))
    print("\nsteady call, bytes received over the ring per call (TCP_INFO): the same for the unwatched "
          "sides means graphkern adds no collective; the watched side adds its per-call check")
    for name in reports[0]["steady"]:
        print(f"{name:>20}  " + "   ".join(f"rank {r}: {rep['steady'][name]['bytes']}"
                                         for r, rep in enumerate(reports)))
    print("\nagreeing on a new signature, median us (one agreement receives "
          + ", ".join(f"{rep['agreement_bytes']} bytes on rank {r}" for r, rep in enumerate(reports))
          + ")")
    for name in reports[0]["agreement"]:
        print(f"{name:>20}  " + "   ".join(f"rank {r}: {rep['agreement'][name] * 1e6:8.1f}"
                                         for r, rep in enumerate(reports)))
    print("\nfirst call of a new signature, ms (mean of two signatures)")
    for name in reports[0]["first"]:
        print(f"{name:>20}  " + "   ".join(f"rank {r}: {rep['first'][name] * 1e3:8.1f}"
                                         for r, rep in enumerate(reports)))
    share = [rep["agreement"]["agreement"] / rep["first"]["gk.wrap"] for rep in reports]
    print(f"\nthe agreement is {', '.join(f'{s * 100:.2f}%' for s in share)} of gk.wrap's first call "
          f"(rank 0, rank 1); unwatched steady calls exchange nothing")
    print("\na watched call's per-call check, median us (one check receives "
          + ", ".join(f"{rep['check_bytes']} bytes on rank {r}" for r, rep in enumerate(reports)) + ")")
    for name in reports[0]["check"]:
        print(f"{name:>20}  " + "   ".join(f"rank {r}: {rep['check'][name] * 1e6:8.1f}"
                                         for r, rep in enumerate(reports)))
    share = [rep["check"]["check_step"] / rep["steady"]["gk.wrap(timeout=60)"]["median"] for rep in reports]
    print(f"the check is {', '.join(f'{s * 100:.2f}%' for s in share)} of a watched steady call "
          f"(rank 0, rank 1)")


if __name__ == "__main__":
    if "MLX_RANK" not in os.environ:
        launch()
    else:
        rank_main(arguments())
