"""Run a scenario of ``ring_worker.py`` as the ranks of one job over MLX's ring on 127.0.0.1.

``graphkern.distributed.launcher.run_ranks`` starts the ranks (a hostfile of free loopback ports,
``MLX_RANK`` and ``MLX_HOSTFILE`` per rank, a process group each, killed when the job overruns its
time, after asking each stuck rank for its stacks). Each rank's result is read from the file it
writes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from graphkern.distributed.launcher import run_ranks

WORKER = Path(__file__).with_name("ring_worker.py")
REPO = Path(__file__).resolve().parents[1]


class RankFailed(AssertionError):
    """A rank did not finish its scenario; carries every rank's output."""


def run_scenario(scenario: str, folder: Path, *, size: int = 2,
                 timeout: float = 150.0) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``size`` ranks; every rank's result dict, in rank order. A rank the
    watchdog ended (a call stuck inside MLX after an abort) gives ``{"ended_by_watchdog": report}``,
    one killed by a signal ``{"killed_by": signal}``."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {"GRAPHKERN_FLIGHT_DIR": str(folder / "flight"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runs = run_ranks([sys.executable, str(WORKER), scenario, str(folder)], size, timeout=timeout,
                     env=env, stack_signal=signal.SIGUSR1)
    logs = "\n".join(f"--- rank {run.rank} (exit {run.returncode}):\n" + "\n".join(
        line for line in run.output.splitlines() if not line.startswith("[ring] "))[-6000:]
        for run in runs)
    if runs[0].timed_out:
        raise RankFailed(f"{scenario}: the ranks overran {timeout:.0f} s and were killed\n{logs}")
    results = []
    for run in runs:
        path = folder / f"result{run.rank}.json"
        if not path.exists() and run.returncode == 1 and "graphkern watchdog: " in run.output:
            report = run.output[run.output.index("graphkern watchdog: "):]
            results.append({"rank": run.rank, "ended_by_watchdog": report})
            continue
        if not path.exists() and run.returncode < 0:
            results.append({"rank": run.rank, "killed_by": -run.returncode})
            continue
        if not path.exists():
            raise RankFailed(f"{scenario}: rank {run.rank} wrote no result\n{logs}")
        result = json.loads(path.read_text())
        if "traceback" in result:
            raise RankFailed(f"{scenario}: rank {run.rank} raised\n{result['traceback']}\n{logs}")
        results.append(result)
    return results
