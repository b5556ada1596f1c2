"""Run a command as every rank of a ring job on this machine, over 127.0.0.1.

What ``mlx.launch -n N --backend ring`` sets up locally (a hostfile of loopback ports, ``MLX_RANK``
and ``MLX_HOSTFILE`` per rank), for tests, CI and benchmarks: every rank's exit status and output
are kept (``mlx.launch`` exits 0 even when ranks fail), a timeout kills every rank's process group
(the ring has none of its own), and nothing is left in the temporary directory (the ranks' flight
folders go in the job's own folder, unless ``GRAPHKERN_FLIGHT_DIR`` says where).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RankRun", "free_ports", "run_ranks"]


@dataclass(frozen=True)
class RankRun:
    """How one rank ended: its exit status (negative: killed by that signal), its output (stdout
    and stderr together) and whether the job overran its timeout."""

    rank: int
    returncode: int
    output: str
    timed_out: bool


def free_ports(count: int) -> list[int]:
    """``count`` different loopback ports nothing listens on now.

    >>> len(set(free_ports(2)))
    2
    """
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_ranks(command: Sequence[str], size: int = 2, *, timeout: float = 600.0,
              env: dict[str, str] | None = None, stack_signal: int | None = None) -> list[RankRun]:
    """Run ``command`` as ranks ``0 .. size-1`` of one ring job and wait for all of them (at most
    ``timeout`` seconds, then every rank still running is killed with its process group). With
    ``stack_signal``, ranks still running at the timeout get that signal a second before they are
    killed (a rank that registered ``faulthandler`` for it prints where it is).

    >>> import sys
    >>> code = "import mlx.core as mx; g = mx.distributed.init(); print(g.rank(), g.size())"
    >>> sorted(r.output.strip() for r in run_ranks([sys.executable, "-c", code], timeout=60))
    ['0 2', '1 2']
    """
    with tempfile.TemporaryDirectory(prefix="graphkern-ranks-") as folder:
        hostfile = Path(folder) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(size)]))
        logs = [open(Path(folder) / f"rank{rank}.log", "w+b") for rank in range(size)]  # noqa: SIM115
        environment = {"GRAPHKERN_FLIGHT_DIR": str(Path(folder) / "flight"), **os.environ, **(env or {}),
                       "MLX_HOSTFILE": str(hostfile)}
        procs = [subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**environment, "MLX_RANK": str(rank)})
                 for rank, log in enumerate(logs)]
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            stuck = [proc for proc in procs if proc.poll() is None]
            if stuck and stack_signal is not None:
                for proc in stuck:
                    os.kill(proc.pid, stack_signal)
                time.sleep(1.0)
            for proc in stuck:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        runs = []
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            runs.append(RankRun(rank, proc.returncode, log.read().decode(errors="replace"), timed_out))
            log.close()
        return runs
