"""Run a command as every rank of a ring job on this machine, over 127.0.0.1.

What ``mlx.launch -n N --backend ring`` sets up locally (a hostfile of loopback ports, ``MLX_RANK``
and ``MLX_HOSTFILE`` per rank), for tests, CI and benchmarks: every rank's exit status and output
are kept (``mlx.launch`` exits 0 even when ranks fail), a timeout kills every rank's process group
(the ring has none of its own). The ranks' flight folders go in a folder of the job's own (unless
``GRAPHKERN_FLIGHT_DIR`` says where), and since only the launcher sees every rank's exit status,
it alone decides what stays (``GRAPHKERN_FLIGHT_KEEP`` tells the ranks): after a job whose every
rank exited 0 nothing is left behind; after any other end (a rank killed, crashed or exiting
with an error, a timeout, an abort) the flight folder stays for the post-mortem, and each
``RankRun`` names it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .watchdog import KEEP_ENV

__all__ = ["RankRun", "free_ports", "run_ranks"]


@dataclass(frozen=True)
class RankRun:
    """How one rank ended: its exit status (negative: killed by that signal), its output (stdout
    and stderr together), whether the job overran its timeout, and the job's flight folder when
    it was kept (the job did not end with every rank exiting 0; else None)."""

    rank: int
    returncode: int
    output: str
    timed_out: bool
    flight: str | None = None


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
                       "MLX_HOSTFILE": str(hostfile), KEEP_ENV: "1"}
        flight = Path(environment["GRAPHKERN_FLIGHT_DIR"])
        before = {p.name for p in _job_folders(flight)}
        procs = [subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**environment, "MLX_RANK": str(rank)})
                 for rank, log in enumerate(logs)]
        timed_out = _wait(procs, timeout, stack_signal)
        made = [p for p in _job_folders(flight) if p.name not in before]
        ended_well = not timed_out and all(proc.returncode == 0 for proc in procs)
        kept = _settle_flight(flight, made, ended_well, own=flight.parent == Path(folder))
        runs = []
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            runs.append(RankRun(rank, proc.returncode, log.read().decode(errors="replace"), timed_out, kept))
            log.close()
        return runs


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float, stack_signal: int | None) -> bool:
    """Wait for every rank, at most ``timeout`` seconds, then kill what still runs; whether it had to."""
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
    return timed_out


def _job_folders(flight: Path) -> list[Path]:
    """The jobs' flight folders (``graphkern-flight-<token>``) in ``flight``."""
    if not flight.is_dir():
        return []
    return [p for p in flight.iterdir() if p.name.startswith("graphkern-flight-") and p.is_dir()]


def _settle_flight(flight: Path, made: list[Path], ended_well: bool, own: bool) -> str | None:
    """After the job: remove the flight folders it made when every rank exited 0 and none aborted;
    else keep them (out of the launcher's temporary folder, when ``flight`` is in it) and say where."""
    if ended_well and not any((p / "abort.json").exists() for p in made):
        for p in made:
            shutil.rmtree(p, ignore_errors=True)
        return None
    if not made:
        return None
    if not own:
        return str(flight)
    kept = Path(tempfile.mkdtemp(prefix="graphkern-flight-kept-")) / "flight"
    shutil.move(str(flight), str(kept))
    return str(kept)
