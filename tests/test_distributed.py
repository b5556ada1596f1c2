"""graphkern across processes (``graphkern.distributed``).

The first tests run in this process, where ``mx.distributed.init()`` is a group of one. The
others really run two processes over MLX's ring backend on 127.0.0.1 (``tests/helpers/ring.py`` starts
them, ``tests/helpers/ring_worker.py`` is each rank): every scenario runs once per module, bounded by a
timeout that kills the ranks' process groups, and several tests read what its ranks saw.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.nn.layers.distributed as mlx_distributed
import pytest
from click.testing import CliRunner
from mlx.nn.layers.distributed import sum_gradients
from ring import run_scenario

import graphkern as gk
from graphkern.cli import main
from graphkern.distributed import CollectiveTimeout, GroupError, JobAborted, merge, watchdog
from graphkern.distributed.collectives import REAL
from graphkern.distributed.launcher import run_ranks
from graphkern.distributed.watchdog import Job
from graphkern.models.tiny import tiny_model
from graphkern.viz.html import viewer_data
from graphkern.viz.model_explorer import to_model_explorer

TOKENS = mx.array([[3, 1, 4, 1, 5, 9]])
ATOL = 1e-4


def every_collective(x: mx.array) -> mx.array:
    group = mx.distributed.init()
    x = mx.distributed.all_sum(x, group=group)
    x = mx.distributed.all_max(x)
    x = mx.distributed.all_min(x)
    x = mx.distributed.all_gather(x)
    x = mx.distributed.sum_scatter(x)
    return sum_gradients(group)(x) * 2


# ----------------------------------------------------------------------------- one process


def test_collectives_are_nodes_and_nothing_stays_patched() -> None:
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    graph = gk.trace(every_collective, x)
    graph.lint()
    nodes = graph.nodes("collective")
    assert [graph.node(n)["op"] for n in nodes] == ["all_sum", "all_max", "all_min", "all_gather",
                                                    "sum_scatter", "sum_gradients"]
    assert [graph.node(n)["reduce"] for n in nodes] == ["sum", "max", "min", None, "sum", "sum"]
    assert {(graph.node(n)["group_size"], graph.node(n)["rank"], graph.node(n)["peer"])
            for n in nodes} == {(1, 0, None)}
    assert [graph.node(n)["call_index"] for n in nodes] == list(range(6))
    assert graph.output_types(nodes[0]) == ["float32[2, 3]"]
    assert graph.nx.graph["group_size"] == 1 and graph.nx.graph["rank"] == 0
    assert mx.array_equal(gk.compile(every_collective)(x), x * 2)  # the real ones, in a group of one
    assert all(getattr(mx.distributed, name) is real for name, real in REAL.items())
    for binding in (globals()["sum_gradients"], mlx_distributed.sum_gradients):  # MLX's lru_cache again
        assert hasattr(binding, "cache_info")
    again = gk.Graph.from_json(graph.to_json())
    assert again == graph and again.node(nodes[0])["reduce"] == "sum"


def test_a_sharded_model_runs_in_a_group_of_one() -> None:
    model = tiny_model("llama")
    ref = model(TOKENS)
    model.shard()  # mx.distributed.init(): this process alone
    graph = gk.trace(model, TOKENS)
    graph.lint()
    nodes = graph.nodes("collective")
    assert len(nodes) == 14  # per layer: 5 sum_gradients (q, k, v, gate, up), 2 all_sum (o, down)
    assert {graph.node(n)["scope"] for n in nodes if graph.node(n)["op"] == "all_sum"} == {
        f"model.layers.{i}.{where}" for i in (0, 1) for where in ("self_attn.o_proj", "mlp.down_proj")}
    assert mx.allclose(gk.wrap(model)(TOKENS), ref, atol=ATOL)
    assert mx.allclose(gk.compile(model)(TOKENS), ref, atol=ATOL)
    dot = graph.to_dot(repeats=False)  # every layer drawn, not the repeated one once
    assert dot.count("hexagon") == len(nodes) and "sum over 1 ranks (rank 0)" in dot
    data = viewer_data(graph)
    assert "collective" in data["kinds"]
    collective = [n for n in data["nodes"] if data["kinds"][n[1]] == "collective"]
    assert len(collective) == 14
    [doc] = to_model_explorer(graph)["graphs"]
    styled = [n for n in doc["nodes"] if n["id"] in nodes]
    assert all(n["style"]["backgroundColor"] == "#ffedd5" for n in styled)
    assert {"key": "group_size", "value": "1"} in styled[0]["attrs"]


def test_other_threads_keep_the_real_collectives_during_a_trace() -> None:
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def traced(x: mx.array) -> mx.array:
        inside.set()
        release.wait(30)
        return mx.distributed.all_sum(x) + 1

    def trace() -> None:
        seen["graph"] = gk.trace(traced, mx.ones((2,)))

    thread = threading.Thread(target=trace)
    thread.start()
    assert inside.wait(30)
    seen["front"] = mx.distributed.all_sum is not REAL["all_sum"]
    seen["here"] = mx.distributed.all_sum(mx.full((2,), 3.0))  # this thread is not tracing
    release.set()
    thread.join(30)
    assert seen["front"] and seen["here"].tolist() == [3.0, 3.0]
    assert seen["graph"].nodes("collective") == ["all_sum"]  # only the traced thread's call
    assert mx.distributed.all_sum is REAL["all_sum"]


def test_overlapping_traces_keep_the_stand_ins_until_the_last_one_ends() -> None:
    group = mx.distributed.init()
    first_inside, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()
    graphs: dict[str, gk.Graph] = {}

    def first(x: mx.array) -> mx.array:
        first_inside.set()
        second_inside.wait(30)  # the second trace starts in here, and outlives this one
        return sum_gradients(group)(x) + 1

    def second(x: mx.array) -> mx.array:
        x = sum_gradients(group)(x)
        second_inside.set()
        first_done.wait(30)
        return sum_gradients(group)(x) * 2

    def run_first() -> None:
        graphs["first"] = gk.trace(first, mx.ones((2,)))
        first_done.set()

    one = threading.Thread(target=run_first)
    one.start()
    assert first_inside.wait(30)
    two = threading.Thread(target=lambda: graphs.update(second=gk.trace(second, mx.ones((2,)))))
    two.start()
    one.join(30)
    two.join(30)
    assert graphs["first"].nodes("collective") == ["sum_gradients"]
    assert [graphs["second"].node(n)["op"] for n in graphs["second"].nodes("collective")] == \
        ["sum_gradients", "sum_gradients"]
    assert hasattr(globals()["sum_gradients"], "cache_info")  # MLX's own again


class Sender(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.send(x, 1) + 1


def test_a_send_in_a_group_of_one_fails_on_its_node_as_mlx_does() -> None:
    with pytest.raises(ValueError, match="Cannot send to a singleton group"):
        mx.distributed.send(mx.ones((2,)), 1)
    graph = gk.trace(nn.Sequential(Sender()), mx.ones((2,)))
    [failed] = [f for f in graph.failures()]
    assert failed.status == gk.Status.MODULE_ERROR and "Cannot send to a singleton group" in failed.message
    assert graph.node(failed.node)["scope"] == "layers.0"


def test_bad_timeouts_and_groups_are_refused() -> None:
    model = tiny_model("llama")
    for timeout in (0, -1.0, float("nan"), "5", True):
        with pytest.raises(gk.KernelError, match="timeout must be a positive number") as info:
            gk.compile(model, timeout=timeout)  # type: ignore[arg-type]
        assert info.value.status == gk.Status.INVALID_INPUT
    with pytest.raises(gk.KernelError, match="group must be an mx.distributed.Group"):
        gk.wrap(model, group="world")
    assert gk.compile(model, timeout=5.0).group is None  # one rank: nothing to agree or watch


def test_merge_refuses_what_is_not_one_job() -> None:
    graph = gk.trace(every_collective, mx.ones((2, 3)))
    with pytest.raises(gk.KernelError, match="no graphs given"):
        merge([])
    with pytest.raises(gk.KernelError, match="two graphs are of rank 0"):
        merge([graph, graph])


def test_an_abort_in_the_flight_folder_stops_the_next_watched_call(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHKERN_FLIGHT_DIR", str(tmp_path))
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    job = Job(0, 2)
    job.join(0x1234)  # the token of the job's first agreement
    with job.watch(30.0, "f(float32[2])", ("all_sum(sum) float32[2] -> float32[2] over 2",)):
        pass
    folder = job.folder
    assert folder is not None and folder.path == str(tmp_path / "graphkern-flight-0000000000001234")
    now = time.time()
    theirs = {"kind": "timeout", "rank": 1, "seq": 1, "call": "f(float32[2])", "timeout": 1.0, "time": now}
    assert folder.claim(theirs) == theirs
    assert folder.claim({**theirs, "rank": 0}) == theirs  # the first rank to abort stands
    folder.write_record(1, [{"seq": 1, "call": "f(float32[2])", "collectives": [], "count": 1,
                             "state": "entered", "entered": now - 1.0, "finished": None}])
    deadline = time.monotonic() + 10
    while job.reason is None and time.monotonic() < deadline:  # the watchdog thread polls the folder
        time.sleep(0.01)
    with pytest.raises(CollectiveTimeout) as info, job.watch(30.0, "f(float32[2])", ()):
        pass
    assert info.value.rank == 1 and "rank 1 waited over 1.0 s" in str(info.value)
    assert "rank 0: #0 f(float32[2]) completed" in str(info.value)
    assert "rank 1: #1 f(float32[2]) entered 1.00 s before the abort, never finished" in str(info.value)
    assert json.loads((Path(folder.path) / "rank0.json").read_text())[0]["state"] == "completed"
    job.end()
    assert Path(folder.path, "abort.json").exists()  # an aborted job's folder stays


@pytest.mark.slow
def test_an_earlier_jobs_abort_stops_no_later_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mlx.launch -n 2`` writes the same hostfile every time: an aborted job's record must not
    stop the next job on the machine, and a job that ends cleanly leaves no folder."""
    monkeypatch.delenv("GRAPHKERN_FLIGHT_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    earlier = Job(0, 2)
    earlier.join(earlier.proposal)
    earlier._abort({"kind": "timeout", "rank": 1, "seq": 0, "call": "f(float32[2])", "timeout": 1.0,
                    "time": time.time()})
    later = Job(0, 2)
    later.join(later.proposal)
    assert earlier.folder is not None and later.folder is not None
    assert later.folder.path != earlier.folder.path and Path(later.folder.path).parent == tmp_path
    with later.watch(30.0, "f(float32[2])", ()):
        time.sleep(0.3)  # the watchdog thread looks at the folder every 0.05 s
    assert later.reason is None
    # a record older than the job, even in the job's own folder, is an earlier job's
    later.folder.claim({**earlier.reason, "time": later.started - 60.0})  # type: ignore[dict-item]
    with later.watch(30.0, "f(float32[2])", ()):
        time.sleep(0.3)
    assert later.reason is None and later.error(None) is None
    Path(later.folder.abort_path).unlink()
    peer = Job(1, 2)  # the later job's other rank
    peer.join(later.token)  # type: ignore[arg-type]
    later.end()
    assert Path(later.folder.path).exists()  # rank 1 has not ended yet
    peer.end()
    assert not Path(later.folder.path).exists()  # every rank ended cleanly: nothing left behind
    earlier.end()
    assert Path(earlier.folder.abort_path).exists()  # aborted: kept for the post-mortem


def _joined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token: int = 0x1234) -> tuple[Job, Job]:
    """Both ranks of a job of two, in this process, sharing a flight folder in ``tmp_path``."""
    monkeypatch.setenv("GRAPHKERN_FLIGHT_DIR", str(tmp_path))
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)  # no ring connections to shut
    monkeypatch.delenv("GRAPHKERN_FLIGHT_KEEP", raising=False)
    ranks = Job(0, 2), Job(1, 2)
    for job in ranks:
        job.join(token)
    return ranks


def test_a_lost_connection_aborts_the_job_and_names_the_rank_that_died(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer killed mid-job: the call that loses its ring connection aborts the job, the error
    says which rank died and when, and the flight folder stays for the post-mortem."""
    monkeypatch.setattr(watchdog, "_GRACE", 0.2)  # rank 1 never writes its record
    job, _ = _joined(tmp_path, monkeypatch)
    with job.watch(30.0, "f(float32[2])", ()):
        pass
    with pytest.raises(JobAborted) as info, job.watch(30.0, "f(float32[2])", ("all_sum(sum) float32[2]",)):
        raise RuntimeError("[ring] Socket 3 was closed by the peer")
    message = str(info.value)
    assert type(info.value) is JobAborted and info.value.rank is None
    assert "rank 1 died (killed or crashed: it left no flight record); rank 0 lost its ring connection at " \
           in message
    assert " s into call #1 f(float32[2]); the job is aborted" in message
    assert "rank 0: #1 f(float32[2]) failed at the abort" in message
    assert "rank 1: no flight record (its process ended or hung before writing one)" in message
    assert re.search(r"(?<![\w\]])-\d", message) is None  # no negative durations
    folder = Path(job.folder.path)  # type: ignore[union-attr]
    assert json.loads((folder / "abort.json").read_text())["kind"] == "lost"
    job.end()
    assert (folder / "abort.json").exists() and (folder / "rank0.json").exists()  # kept


def test_times_in_a_report_are_never_negative() -> None:
    """A rank whose call failed just after the abort (its own abort, or a peer's) is 'after'."""
    now = 1_000_000.0
    reason = {"kind": "timeout", "rank": 0, "seq": 3, "call": "f(float32[2])", "timeout": 1.0, "time": now}
    records = {0: [{"seq": 3, "call": "f(float32[2])", "collectives": [], "count": 0, "state": "failed",
                    "entered": now - 1.2, "finished": now + 0.25}],
               1: [{"seq": 2, "call": "f(float32[2])", "collectives": [], "count": 0, "state": "completed",
                    "entered": now - 0.6, "finished": now - 0.5}]}
    message = str(watchdog._aborted(reason, records, 2))
    assert "rank 0: #3 f(float32[2]) failed 0.25 s after the abort" in message
    assert "rank 1: #2 f(float32[2]) completed 0.50 s before the abort" in message
    records[0][0]["finished"] = now - 0.0001
    assert "failed at the abort" in str(watchdog._aborted(reason, records, 2))
    assert "-0.00" not in str(watchdog._aborted(reason, records, 2))


def test_the_flight_folder_goes_only_when_every_rank_ended_cleanly(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rank0, rank1 = _joined(tmp_path, monkeypatch, 0x1)
    folder = Path(rank0.folder.path)  # type: ignore[union-attr]
    rank0.end()
    assert sorted(p.name for p in folder.iterdir()) == ["ended0"]  # rank 1 may still fail
    rank0.end()  # once only (it is also registered at exit)
    rank1.end()
    assert not folder.exists()
    # rank 0's last watched call failed (not a lost connection, no abort): its end is not clean
    rank0, rank1 = _joined(tmp_path, monkeypatch, 0x2)
    folder = Path(rank0.folder.path)  # type: ignore[union-attr]
    with pytest.raises(ValueError), rank0.watch(30.0, "f(float32[2])", ()):
        raise ValueError("a bug in the caller")
    rank0.end()
    rank1.end()
    assert sorted(p.name for p in folder.iterdir()) == ["ended1", "rank0.json"]
    assert json.loads((folder / "rank0.json").read_text())[-1]["state"] == "failed"
    # under a launcher that sees the exit statuses (run_ranks), the launcher decides
    rank0, rank1 = _joined(tmp_path, monkeypatch, 0x3)
    monkeypatch.setenv("GRAPHKERN_FLIGHT_KEEP", "1")
    rank0.end()
    rank1.end()
    assert Path(rank0.folder.path).exists()  # type: ignore[union-attr]


_FLIGHT_RANK = """import os, sys
rank = int(os.environ["MLX_RANK"])
job = os.path.join(os.environ["GRAPHKERN_FLIGHT_DIR"], "graphkern-flight-00000000000000ab")
os.makedirs(job, exist_ok=True)
open(os.path.join(job, f"rank{rank}.json"), "w").write("[]")
print(os.environ["GRAPHKERN_FLIGHT_KEEP"])
sys.exit(int(sys.argv[1]) if rank == 1 else 0)
"""


def test_run_ranks_keeps_the_flight_folder_of_a_job_that_did_not_end_well(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHKERN_FLIGHT_DIR", raising=False)
    failed = run_ranks([sys.executable, "-c", _FLIGHT_RANK, "3"], 2, timeout=60)
    assert [r.returncode for r in failed] == [0, 3] and {r.output.strip() for r in failed} == {"1"}
    kept = failed[0].flight
    assert kept is not None and all(r.flight == kept for r in failed)
    job = Path(kept) / "graphkern-flight-00000000000000ab"
    assert sorted(p.name for p in job.iterdir()) == ["rank0.json", "rank1.json"]
    shutil.rmtree(Path(kept).parent)
    ok = run_ranks([sys.executable, "-c", _FLIGHT_RANK, "0"], 2, timeout=60)
    assert [r.flight for r in ok] == [None, None]
    # a flight directory of the caller's: what this job made goes after a clean end, the rest stays
    (tmp_path / "graphkern-flight-earlier").mkdir()
    ok = run_ranks([sys.executable, "-c", _FLIGHT_RANK, "0"], 2, timeout=60,
                   env={"GRAPHKERN_FLIGHT_DIR": str(tmp_path)})
    assert [r.flight for r in ok] == [None, None]
    assert [p.name for p in tmp_path.iterdir()] == ["graphkern-flight-earlier"]
    failed = run_ranks([sys.executable, "-c", _FLIGHT_RANK, "1"], 2, timeout=60,
                       env={"GRAPHKERN_FLIGHT_DIR": str(tmp_path)})
    assert failed[0].flight == str(tmp_path) and (tmp_path / "graphkern-flight-00000000000000ab").is_dir()


def test_run_ranks_leaves_no_flight_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHKERN_FLIGHT_DIR", raising=False)
    code = "import os; print(os.environ['GRAPHKERN_FLIGHT_DIR'])"
    runs = run_ranks([sys.executable, "-c", code], 2, timeout=60)
    [folder] = {run.output.strip() for run in runs}
    assert Path(folder).name == "flight" and Path(folder).parent.name.startswith("graphkern-ranks-")
    assert not Path(folder).parent.exists()


# ----------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def models_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("models")
    return folder, run_scenario("models", folder)


@pytest.fixture(scope="module")
def refusals_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("refusals")
    return folder, run_scenario("refusals", folder)


@pytest.fixture(scope="module")
def runtime_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("runtime")
    return folder, run_scenario("runtime", folder)


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("killed")
    return folder, run_scenario("killed", folder, timeout=90)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_every_rank_traces_its_collectives(models_job: Any, arch: str) -> None:
    _, ranks = models_job
    for rank, result in enumerate(ranks):
        seen = result[arch]
        assert seen["graph_attrs"]["rank"] == rank and seen["graph_attrs"]["group_size"] == 2
        assert {(op, size, r) for op, size, r, _ in seen["collectives"]} == {
            ("all_sum", 2, rank), ("sum_gradients", 2, rank)}
        all_sums = [scope for op, _, _, scope in seen["collectives"] if op == "all_sum"]
        inner = ["mlp", "mlp"] if arch == "qwen3_moe" else ["mlp.down_proj"] * 2
        assert sorted(all_sums) == sorted([f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)]
                                          + [f"model.layers.{i}.{inner[i]}" for i in (0, 1)])
    assert ranks[0][arch]["collectives"] == [[op, size, 0, scope] for op, size, _, scope in
                                            ranks[1][arch]["collectives"]]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_wrap_compile_and_patch_match_the_unsharded_model_on_every_rank(models_job: Any,
                                                                        arch: str) -> None:
    _, ranks = models_job
    for result in ranks:
        seen = result[arch]
        for how in ("wrap", "wrap_steady", "compile", "compile_steady", "patched"):
            assert seen[how] < ATOL, (how, seen[how])
        # kernels in the sharded layers too: SwiGLU between the sharded gate/up and down projections
        assert "gk_swiglu" in seen["patched_kernels"] and len(seen["patched_kernels"]) >= 3
        assert seen["job_cross_edges"] == 8  # 4 all_sums, each reading the other rank's input
    assert ranks[0]["llama"]["cache"] < ATOL and ranks[1]["llama"]["cache"] < ATOL  # prefill + decode
    assert ranks[0][arch]["patched_kernels"] == ranks[1][arch]["patched_kernels"]


@pytest.mark.slow
def test_inspect_runs_a_sharded_model_node_by_node_on_every_rank(models_job: Any) -> None:
    _, ranks = models_job
    for result in ranks:
        seen = result["llama"]["inspect"]
        assert seen["status"] == gk.Status.OK and seen["values"]["unreached"] == 0
        assert abs(seen["mean"] - seen["ref_mean"]) < 1e-5  # the logits' mean, as unsharded


@pytest.mark.slow
def test_a_pipelined_model_sends_and_receives(models_job: Any) -> None:
    _, (rank0, rank1) = models_job
    assert [c[0] for c in rank0["pipeline"]["collectives"]] == ["recv", "all_gather"]
    assert [c[0] for c in rank1["pipeline"]["collectives"]] == ["send", "all_gather"]
    assert rank0["pipeline"]["peers"] == [1, None] and rank1["pipeline"]["peers"] == [0, None]
    assert rank0["pipeline"]["wrap"] < ATOL and rank1["pipeline"]["wrap"] < ATOL


@pytest.mark.slow
def test_one_picture_of_the_job(models_job: Any) -> None:
    folder, _ = models_job
    files = [str(folder / f"llama_rank{r}.json") for r in (0, 1)]
    job = merge([gk.Graph.from_json(Path(f).read_text()) for f in files])
    job.lint()
    assert job.ok and {job.node(n)["on_rank"] for n in job.nodes()} == {0, 1}
    assert {job.node(n)["scope"].split(".")[0] for n in job.nodes()} == {"rank0", "rank1"}
    cross = [(u, v) for u, v, d in job.nx.edges(data=True) if d.get("cross_rank")]
    assert len(cross) == 8
    for u, v in cross:  # a rank's all_sum reads the array the other rank gave its own
        assert job.node(v)["op"] == "all_sum" and job.node(u)["on_rank"] != job.node(v)["on_rank"]
        [mine] = [p for p in job.nx.predecessors(v) if job.node(p)["on_rank"] == job.node(v)["on_rank"]]
        assert job.node(u)["op"] == job.node(mine)["op"] and job.node(u)["scope"][5:] == \
            job.node(mine)["scope"][5:]
    out = folder / "job.html"
    result = CliRunner().invoke(main, ["show", *files, "--html", str(out), "--brief"])
    assert result.exit_code == 0, result.output
    assert "graph Model on 2 ranks" in result.output and "collectives" in result.output
    data = json.loads(out.read_text().split('<script id="gk-data" type="application/json">')[1]
                      .split("</script>")[0])
    assert sum(1 for e in data["edges"] if len(e) == 7 and e[6] == 1) == 8
    assert {g[0] for g in data["groups"] if g[3] == 0} == {"rank0", "rank1"}  # one lane per rank


@pytest.mark.slow
def test_a_failure_on_one_rank_is_refused_on_every_rank(refusals_job: Any) -> None:
    _, ranks = refusals_job
    for result in ranks:
        failure = result["failure"]
        assert failure["type"] == "GroupError" and failure["rank"] == 1
        assert failure["node"] == "injected" and failure["status"] == gk.Status.INVALID_LAUNCH
        assert "rank 1 of 2 cannot run Model(int32[1, 6])" in failure["message"]
        assert "threadgroup entries must be positive" in failure["message"]
        assert result["after_failure"] < ATOL  # the group is usable: the next signature runs


@pytest.mark.slow
def test_the_failed_rank_blast_radius_reaches_every_rank(refusals_job: Any) -> None:
    folder, _ = refusals_job
    job = gk.Graph.from_json((folder / "failed_job.json").read_text())  # gathered by the ranks
    job.lint()
    [root] = job.failures()
    assert root.node == "rank1/injected" and root.status == gk.Status.INVALID_LAUNCH
    reached = {job.node(n)["on_rank"] for n in job.nodes()
               if job.node(n)["status"] == gk.Status.UPSTREAM_FAILED}
    assert reached == {0, 1}
    assert job.node("rank0/output_0")["root_cause"] == "rank1/injected"
    # rank 0 is reached through the last all_sum (layer 1's MLP), not before it
    assert job.node("rank0/all_sum_3")["status"] == gk.Status.UPSTREAM_FAILED
    assert job.node("rank0/all_sum_2")["status"] == gk.Status.OK
    files = [str(folder / f"failed_rank{r}.json") for r in (0, 1)]
    result = CliRunner().invoke(main, ["show", *files, "--brief"])
    assert result.exit_code == 1
    assert "FAILED: rank1/injected in rank1.model.layers.1.post_attention_layernorm: INVALID_LAUNCH" \
        in result.output


@pytest.mark.slow
def test_mismatched_collective_sequences_are_refused(refusals_job: Any) -> None:
    _, ranks = refusals_job
    for result in ranks:
        mismatch = result["mismatch"]
        assert mismatch["type"] == "GroupError" and mismatch["collective"] == 0
        assert mismatch["node"] == "sum_gradients" and mismatch["in_step"] is True
        assert "rank 0: sum_gradients(sum) float32[2, 2, 64]" in mismatch["message"]
        assert "rank 1: sum_gradients(sum) float32[3, 2, 64]" in mismatch["message"]
        assert result["after_mismatch"] < ATOL
        assert result["mismatch_again"] == mismatch  # remembered: refused again without a collective


@pytest.mark.slow
def test_watched_calls_crossing_signatures_both_ranks_traced_are_refused(refusals_job: Any) -> None:
    """Both ranks traced both signatures (so no agreement is due); rank 0 calls one, rank 1 the
    other: the watched call's check refuses it on both ranks, and the group stays usable."""
    _, ranks = refusals_job
    for result in ranks:
        crossed = result["crossed"]
        assert crossed["type"] == "GroupError" and crossed["in_step"] is True
        assert "rank 0 Model(int32[1, 2]), rank 1 Model(int32[1, 1])" in crossed["message"]
        assert "collective #0: rank 0: sum_gradients(sum) float32[1, 2, 64]" in crossed["message"]
        assert max(result["crossed_ok"]) < ATOL and result["after_crossed"] < ATOL


@pytest.mark.slow
def test_the_flight_folder_is_the_jobs_own(refusals_job: Any) -> None:
    folder, _ = refusals_job
    [job] = list((folder / "flight").iterdir())  # one job, named after its token
    assert job.name.startswith("graphkern-flight-") and (job / "abort.json").exists()
    assert json.loads((job / "abort.json").read_text())["kind"] == "timeout"


@pytest.mark.slow
def test_the_watchdog_turns_a_stall_into_an_error_on_every_rank(refusals_job: Any) -> None:
    _, (rank0, rank1) = refusals_job
    if "ended_by_watchdog" in rank0:
        # its call never came back from MLX after the abort: the report, then the process ended
        report = rank0["ended_by_watchdog"]
        assert "rank 0 waited over 1.5 s" in report and "it never entered #" in report
    else:
        assert rank0["watched"] < ATOL
        stall = rank0["stall"]
        assert stall["type"] == "CollectiveTimeout" and stall["rank"] == 0
        assert 1.5 <= rank0["stall_seconds"] < 10  # the timeout, plus waiting for rank 1's record
        assert rank0["after_abort"]["type"] == "CollectiveTimeout"
        records = stall["records"]
        last0, last1 = records["0"][-1], records["1"][-1]
        assert last0["state"] == "entered" and last1["state"] == "completed"
        assert last0["seq"] == last1["seq"] + 1 and last0["call"] == "Model(int32[1, 2])"
        assert last0["collectives"][0].startswith("all_sum(sum) float32[1, 2, 64]")
        assert f"it never entered #{last0['seq']}" in stall["message"]
    assert rank1["watched"] < ATOL
    stall = rank1["stall"]  # rank 1 comes back from its stall to the abort
    assert stall["type"] == "CollectiveTimeout" and stall["rank"] == 0
    assert "rank 0 waited over 1.5 s" in stall["message"]
    assert rank1["stall_seconds"] < 2 and rank1["after_abort"]["type"] == "CollectiveTimeout"
    last1 = stall["records"]["1"][-1]
    assert last1["state"] == "completed" and f"it never entered #{last1['seq'] + 1}" in stall["message"]


@pytest.mark.slow
def test_a_run_failure_is_attributed_on_its_rank_alone(runtime_job: Any) -> None:
    _, (rank0, rank1) = runtime_job
    first = rank1["first"]
    assert first["type"] == "GraphError" and first["node"].startswith("inverse")
    assert first["status"] == gk.Status.RUNTIME_ERROR and "LU factorization failed" in first["message"]
    assert rank1["second"] == first and rank1["graph_status"] == gk.Status.RUNTIME_ERROR
    # the re-run that found the kernel sent nothing: it ended while rank 0 slept, out of every
    # collective (ranks share the machine's clock)
    assert rank1["first_ended"] < rank0["second_started"]
    # rank 0's call ran; its next hears of rank 1's failure instead of waiting for it
    assert rank0["first"] == {"ok": True}
    second = rank0["second"]
    assert second["type"] == "JobAborted" and second["rank"] == 1 and second["node"] == first["node"]
    assert "rank 1 failed while running" in second["message"]


@pytest.mark.slow
def test_a_killed_rank_is_named_and_its_jobs_flight_folder_stays(killed_job: Any) -> None:
    folder, (rank0, rank1) = killed_job
    assert rank1 == {"rank": 1, "killed_by": 9}
    assert rank0["first"] == [4.0] * 4
    second = rank0["second"]
    assert second["type"] == "JobAborted" and second["rank"] is None
    message = second["message"]
    assert "rank 1 died (killed or crashed: it left no flight record); rank 0 lost its ring connection at" \
           in message
    assert "rank 0: #2 <lambda>(float32[4]) failed at the abort" in message
    assert re.search(r"(?<![\w\]])-\d", message) is None  # no negative durations
    assert rank0["second_ended"] - rank0["second_started"] < 20  # the loss, not the 30 s timeout
    [job] = list((folder / "flight").iterdir())  # kept: the job did not end well
    assert json.loads((job / "abort.json").read_text())["kind"] == "lost"
    assert json.loads((job / "rank0.json").read_text())[-1]["state"] == "failed"


def test_errors_pickle() -> None:
    import pickle

    for error in (GroupError("x", gk.Status.INVALID_LAUNCH, rank=1, node="k", collective=None),
                  CollectiveTimeout("y", gk.Status.RUNTIME_ERROR, rank=0, reason={"kind": "timeout"},
                                    records={0: []}),
                  JobAborted("z", gk.Status.RUNTIME_ERROR, rank=None, reason={}, records={})):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and again.rank == error.rank
