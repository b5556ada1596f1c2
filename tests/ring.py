"""Run ``ring_worker.py`` as the ranks of one job over MLX's ring backend on 127.0.0.1.

What ``mlx.launch -n 2 --backend ring`` sets up, done here so the test owns the processes: a
hostfile of free loopback ports, ``MLX_RANK`` and ``MLX_HOSTFILE`` per rank, every rank in its own
process group, killed with it when the job overruns its time. Each rank's result is read from the
file it writes (a launcher's exit status says nothing about its ranks).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("ring_worker.py")
REPO = Path(__file__).resolve().parents[1]


def free_ports(count: int) -> list[int]:
    """Loopback ports nothing listens on now (held open together, so they differ)."""
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


class RankFailed(AssertionError):
    """A rank did not finish its scenario; carries every rank's output."""


def run_ranks(scenario: str, folder: Path, *, size: int = 2, timeout: float = 150.0,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``size`` ranks; every rank's result dict, in rank order."""
    folder.mkdir(parents=True, exist_ok=True)
    hostfile = folder / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(size)]))
    base = {**os.environ, "MLX_HOSTFILE": str(hostfile), "GRAPHKERN_FLIGHT_DIR": str(folder / "flight"),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **(env or {})}
    procs = []
    for rank in range(size):
        log = open(folder / f"log{rank}.txt", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(WORKER), scenario, str(folder)],
                                       env={**base, "MLX_RANK": str(rank)}, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log))
    deadline = time.monotonic() + timeout
    overran = False
    try:
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                overran = True
                break
    finally:
        stuck = [proc for proc, _ in procs if proc.poll() is None]
        for proc in stuck:  # where each stuck rank is, in its log, before it is killed
            os.kill(proc.pid, signal.SIGUSR1)
        if stuck:
            time.sleep(1.0)
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    logs = "\n".join(f"--- rank {r} (exit {p.returncode}):\n" + "\n".join(
        line for line in (folder / f"log{r}.txt").read_text(errors="replace").splitlines()
        if not line.startswith("[ring] "))[-6000:] for r, (p, _) in enumerate(procs))
    if overran:
        raise RankFailed(f"{scenario}: the ranks overran {timeout:.0f} s and were killed\n{logs}")
    results = []
    for rank, (proc, _) in enumerate(procs):
        path = folder / f"result{rank}.json"
        log = (folder / f"log{rank}.txt").read_text(errors="replace")
        if not path.exists() and proc.returncode == 1 and "graphkern watchdog: " in log:
            # the watchdog ended the process (a call stuck inside MLX after an abort)
            results.append({"rank": rank, "ended_by_watchdog": log[log.index("graphkern watchdog: "):]})
            continue
        if not path.exists():
            raise RankFailed(f"{scenario}: rank {rank} wrote no result\n{logs}")
        result = json.loads(path.read_text())
        if "traceback" in result:
            raise RankFailed(f"{scenario}: rank {rank} raised\n{result['traceback']}\n{logs}")
        results.append(result)
    return results
