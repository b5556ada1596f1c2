"""Concurrency: 8 threads applying, tracing and calling compiled graphs at once, 1,000 calls each.

With GRAPHKERN_BACKEND=metal, traces build real ``mx.fast.metal_kernel`` objects (Linux MLX builds
and traces them, it cannot run them), so the kernel cache sees real concurrent first uses: each
distinct kernel must be built exactly once (misses == distinct kernels) and the hit/miss counts
must equal the serial run's. Every result (output values, graphs, statuses) must equal the
serial run's, the module hooks (which patch classes, reference-counted) must all be gone
afterwards, and the garbage collector must be left as it was.

Free-running threads rarely meet inside a compiled graph's steady call, so the per-thread call
state (``_CallState``) is also checked on a forced schedule: two threads are held inside MLX's
traces of their steady calls until each has written its state, then let read it back one after
the other; a control run with one state object for both shows that schedule mixes their results.

MLX 0.32 evaluates an array only on the thread whose stream built it ("There is no Stream(cpu, 0)
in current thread"), so inputs and weights are evaluated before they are handed to the threads.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

import graphkern as gk
import graphkern.kernels as gkk
from graphkern.compiling.compiled import _CallState, _PassThrough
from graphkern.launching import backends, mlx_kernels
from graphkern.tracing.module_hooks import ModuleHooks
from graphkern.tracing.traceable import Traceable

THREADS = 8
CALLS = 1_000
N = 8
SPEC = [gk.OutputSpec((N,), mx.float32)]
LAUNCH: dict[str, Any] = dict(grid=(N, 1, 1), threadgroup=(N, 1, 1), template=[("T", mx.float32)])


def _metal(expr: str) -> str:
    return f"uint i = thread_position_in_grid.x; out[i] = {expr};"


KERNELS = [
    gk.Kernel(f"conc_{i}", ["x", "y"], ["out"], metal=_metal(f"x[i] * T({i + 1}) + y[i]"),
              reference=lambda x, y, i=i: [x * (i + 1) + y])
    for i in range(6)
]
# same name as KERNELS[0], another source: a separate cache entry
TWIN = gk.Kernel("conc_0", ["x", "y"], ["out"], metal=_metal("x[i] - y[i]"), reference=lambda x, y: [x - y])
ALL_KERNELS = [*KERNELS, TWIN]


def two_kernels(a: int, b: int) -> Callable[[mx.array, mx.array], mx.array]:
    def fn(x: mx.array, y: mx.array) -> mx.array:
        h = gk.apply_in_graph(ALL_KERNELS[a], [x, y], SPEC, **LAUNCH).outputs[0]
        return gk.apply_in_graph(ALL_KERNELS[b], [mx.tanh(h), y], SPEC, **LAUNCH).outputs[0]
    fn.__name__ = f"two_kernels_{a}_{b}"
    return fn


class KernelBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(N)
        self.proj = nn.Linear(N, N)
        self.index = index

    def __call__(self, x: mx.array) -> mx.array:
        h = self.proj(self.norm(x)).reshape(-1)
        out = gk.apply_in_graph(ALL_KERNELS[self.index], [h, x.reshape(-1)],
                                [gk.OutputSpec(h.shape, h.dtype)], grid=(h.size, 1, 1),
                                threadgroup=(8, 1, 1), template=[("T", h.dtype)]).outputs[0]
        return out.reshape(x.shape)


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        mx.random.seed(seed)
        self.layers = [KernelBlock(seed % 7), KernelBlock((seed + 3) % 7)]
        self.head = nn.Linear(N, 2)

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def graph_digest(graph: gk.Graph) -> tuple[Any, ...]:
    """What a trace must reproduce exactly: every node with kind, op, scope, status, kernel
    identity, and every edge with shape and dtype."""
    nodes = tuple(
        (n, d["kind"], d["op"], d["scope"], d["status"], d.get("source_hash"), d.get("generated_name"),
         d.get("backend"))
        for n, d in sorted(graph.nx.nodes(data=True)))
    edges = tuple(sorted((u, v, k, tuple(d["shape"]), d["dtype"]) for u, v, k, d in
                         graph.nx.edges(keys=True, data=True)))
    return nodes, edges


class Worker:
    """One thread's 1,000 calls: eager applies, failing launches, traces of functions and of
    modules under the metal backend, and compiled calls, interleaved."""

    def __init__(self, index: int, models: list[Model], compiled: gk.CompiledGraph) -> None:
        self.index = index
        self.x = mx.arange(N, dtype=mx.float32) * (index + 1) / 10
        self.y = mx.full((N,), float(index))
        mx.eval(self.x, self.y)
        self.models = models
        self.compiled = compiled
        self.own = gk.compile(two_kernels(index % 7, (index + 1) % 7), backend="reference")

    def run(self, calls: int) -> list[Any]:
        out: list[Any] = []
        for i in range(calls):
            step, k = i % 10, (self.index + i) % len(ALL_KERNELS)
            if step < 5:  # eager, on the reference: values
                [r] = gk.apply(ALL_KERNELS[k], [self.x, self.y], SPEC, backend="reference", **LAUNCH)
                out.append(r)
            elif step == 5:  # a failing launch: a status, never an exception
                res = gk.apply_in_graph(ALL_KERNELS[k], [self.x, self.y], SPEC, grid=(N, 1, 1),
                                        threadgroup=(0, 1, 1))
                out.append((res.status, str(res.error)))
            elif step == 6:  # a traced function with two Metal kernels
                out.append(graph_digest(gk.trace(two_kernels(k, (k + i) % 7), self.x, self.y)))
            elif step == 7:  # a traced nn.Module (class patching is shared between threads)
                model = self.models[(self.index + i) % len(self.models)]
                out.append(graph_digest(gk.trace(model, self.x.reshape(1, N))))
            elif step == 8:  # this thread's compiled graph
                out.append(self.own(self.x, self.y))
            else:  # one compiled graph shared by all threads
                out.append(self.compiled(self.x, self.y))
        mx.eval([r for r in out if isinstance(r, mx.array)])
        return [r.tolist() if isinstance(r, mx.array) else r for r in out]


def make_workers() -> list[Worker]:
    models = [Model(seed) for seed in range(3)]
    mx.eval([m.parameters() for m in models])
    shared = gk.compile(two_kernels(2, 5), backend="reference")
    return [Worker(i, models, shared) for i in range(THREADS)]


def run_threads(workers: list[Worker], calls: int) -> list[list[Any]]:
    barrier = threading.Barrier(len(workers))
    results: list[list[Any] | None] = [None] * len(workers)
    errors: list[BaseException] = []

    def target(w: Worker) -> None:
        try:
            barrier.wait()
            results[w.index] = w.run(calls)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


@pytest.mark.slow
def test_eight_threads_match_the_serial_run_and_build_each_kernel_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHKERN_BACKEND", "metal")
    gc_was_enabled = gc.isenabled()

    serial_cache = mlx_kernels.KernelCache()
    monkeypatch.setattr(mlx_kernels, "kernel_cache", serial_cache)
    serial = [w.run(CALLS) for w in make_workers()]

    concurrent_cache = mlx_kernels.KernelCache()
    monkeypatch.setattr(mlx_kernels, "kernel_cache", concurrent_cache)
    concurrent = run_threads(make_workers(), CALLS)

    assert len(concurrent) == THREADS
    for index, (mine, theirs) in enumerate(zip(concurrent, serial)):
        assert len(mine) == CALLS
        mismatches = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
        assert not mismatches, f"thread {index} differs from the serial run at calls {mismatches[:5]}"

    distinct = len({mlx_kernels.KernelCache.key("metal", k) for k in ALL_KERNELS})
    assert distinct == len(ALL_KERNELS)  # the twin shares a name, not a source
    stats = concurrent_cache.stats()
    assert stats["misses"] == stats["size"] == distinct, stats  # each built exactly once
    assert stats == serial_cache.stats()  # and looked up as often as serially
    assert stats["hits"] > 1_000

    # the class patches are reference-counted back to zero; the GC is as it was
    assert not ModuleHooks._patched
    for cls in (Model, KernelBlock, nn.Linear, nn.RMSNorm):
        assert not hasattr(vars(cls).get("__call__"), "__wrapped__")
    assert gc.isenabled() == gc_was_enabled

    # and everything still works afterwards
    monkeypatch.delenv("GRAPHKERN_BACKEND")
    [r] = gk.apply(KERNELS[1], [mx.ones(N), mx.ones(N)], SPEC, **LAUNCH)
    assert r.tolist() == [3.0] * N


def test_concurrent_traces_of_one_module_instance_keep_their_own_scopes() -> None:
    """Threads tracing the same model while others call a twin of it (the same classes, hooked
    while a trace runs) eagerly: every trace has the scopes of a lone trace, and the eager calls
    are unaffected. (Calling the traced instance itself meanwhile is not supported: a trace puts
    MLX's placeholders in its parameters, as README.md says.)"""
    model, twin = Model(7), Model(7)
    twin.update(model.parameters())
    x = mx.ones((1, N))
    mx.eval(model.parameters(), x)
    expected = graph_digest(gk.trace(model, x))
    eager = twin(x).tolist()
    barrier = threading.Barrier(THREADS)
    failures: list[str] = []

    def work(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(40):
                if index % 2:
                    if graph_digest(gk.trace(model, x)) != expected:
                        failures.append("trace")
                elif twin(x).tolist() != eager:
                    failures.append("eager")
        except Exception as exc:  # noqa: BLE001 - a thread's error fails the test, not the thread
            failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures and not any(t.is_alive() for t in threads)
    assert not ModuleHooks._patched


def race(work: Callable[[int], None]) -> None:
    """Run ``work(index)`` on THREADS threads at once with Python switching between them about
    every microsecond instead of every 5 ms, so a window another thread must not enter is entered
    within a few calls if it is open; fails if a thread hangs."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(previous)
    assert not any(t.is_alive() for t in threads), "a thread hung"


def parameter_arrays(model: nn.Module) -> list[mx.array]:
    return [v for _, v in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))]


def parameter_values(model: nn.Module) -> list[Any]:
    return [v.tolist() for v in parameter_arrays(model)]


def test_threads_tracing_one_model_never_see_each_others_placeholders() -> None:
    """A trace puts placeholders in the model's parameters; eight threads tracing one model, with
    threads switching every microsecond, each trace only its own: no trace bakes another's
    placeholder in as a constant (or fails evaluating it), and the model keeps its own arrays."""
    model = Model(3)
    x = mx.ones((1, N))
    mx.eval(model.parameters(), x)
    before = [id(v) for v in parameter_arrays(model)]
    expected = graph_digest(gk.trace(model, x))
    failures: list[str] = []

    def work(index: int) -> None:
        try:
            for _ in range(60):
                if graph_digest(gk.trace(model, x)) != expected:  # a placeholder is a constant node
                    failures.append("a trace differs from a lone one")
        except Exception as exc:  # noqa: BLE001 - a thread's error fails the test, not the thread
            failures.append(f"{type(exc).__name__}: {exc}")

    race(work)
    assert not failures, failures[:3]
    assert [id(v) for v in parameter_arrays(model)] == before


def test_compiled_calls_tracing_new_signatures_and_traces_of_one_model_at_once() -> None:
    """MLX's trace of a compiled graph with state puts its tracers in the model's parameters, as a
    trace's swap does: threads first-calling new signatures of one ``gk.compile``d model while
    others trace it all get their own results, and the model's parameters are unchanged."""
    model = Model(4)
    mx.eval(model.parameters())
    values = parameter_values(model)
    compiled = gk.compile(model, backend="reference")
    inputs = [mx.random.normal((1 + i, N)) for i in range(THREADS * 4)]
    mx.eval(inputs)
    with backends.using_backend("reference"):
        expected = [model(x).tolist() for x in inputs]
    constants = len(gk.trace(model, inputs[0]).nodes("constant"))
    failures: list[str] = []

    def work(index: int) -> None:
        try:
            for i in range(index, len(inputs), THREADS):
                if index % 2:
                    if len(gk.trace(model, inputs[i]).nodes("constant")) != constants:
                        failures.append("a trace baked a placeholder in")
                elif compiled(inputs[i]).tolist() != expected[i]:
                    failures.append(f"compiled call {i} differs")
        except Exception as exc:  # noqa: BLE001 - a thread's error fails the test, not the thread
            failures.append(f"{type(exc).__name__}: {exc}")

    race(work)
    assert not failures, failures[:3]
    assert parameter_values(model) == values


def test_a_trace_inside_a_placeholder_window_runs_on_its_deep_stack_thread() -> None:
    """A piece of work holding the placeholder window (a float32 copy of a model's state swapped in
    while it traces, as ``gk.compare`` does) traces on a deep-stack thread while it waits: the
    window follows it there instead of deadlocking."""
    model = Model(5)
    x = mx.ones((1, N))
    mx.eval(model.parameters(), x)
    traceable = Traceable(model)
    expected = graph_digest(gk.trace(model, x))
    done: list[gk.Graph] = []

    def work() -> None:
        with traceable.state.swapped(traceable.state.arrays()):
            done.append(gk.trace(model, x))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the nested trace waited for the window its caller holds"
    assert done and graph_digest(done[0]) == expected


def test_a_threads_backend_override_reaches_its_traces() -> None:
    """Traces run on helper threads with deep stacks; a thread's ``using_backend`` override must
    go along, and other threads tracing at the same time must not see it."""
    kernel = ALL_KERNELS[2]

    def fn(x: mx.array, y: mx.array) -> mx.array:
        return gk.apply_in_graph(kernel, [x, y], SPEC, **LAUNCH).outputs[0]

    x = mx.ones((N,))
    mx.eval(x)
    seen: dict[str, tuple[str, str]] = {}
    barrier = threading.Barrier(2)

    def work(backend: str | None) -> None:
        barrier.wait()
        with backends.using_backend(backend):
            for _ in range(20):
                graph = gk.trace(fn, x, x)
                seen[str(backend)] = (graph.node(kernel.name)["backend"], graph.nx.graph["backend"])

    threads = [threading.Thread(target=work, args=(b,)) for b in ("metal", None)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert seen == {"metal": ("metal", "metal"), "None": ("reference", "reference")}


def test_one_compiled_graph_called_from_eight_threads_from_its_steady_path() -> None:
    """Several threads call one compiled graph while it is on the steady path (one signature,
    backend left to graphkern): every result matches the eager function, nothing raises, and a
    second signature from the threads is served the long way, correctly."""
    def fn(x: mx.array, w: mx.array) -> mx.array:
        return gkk.swiglu(gkk.rms_norm(x, w), mx.tanh(x))

    cf = gk.compile(fn)
    x, y = mx.arange(N, dtype=mx.float32) / 7, mx.full((N,), 0.5)
    x2, y2 = mx.ones((2, 3, N)), mx.full((N,), 2.0)
    mx.eval(x, y, x2, y2)
    expected, expected2 = fn(x, y).tolist(), fn(x2, y2).tolist()
    assert cf(x, y).tolist() == expected  # the long way: traced, compiled, run
    assert cf.stats()["steady"]  # the next call from this thread is a steady one
    assert cf(x, y).tolist() == expected

    def work(index: int) -> list[Any]:
        out = []
        for i in range(200):
            if (index + i) % 50 == 0:
                out.append(cf(x2, y2).tolist() == expected2)
            else:
                out.append(cf(x, y).tolist() == expected)
        return out

    results: list[list[Any]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def target(index: int) -> None:
        try:
            barrier.wait()
            results[index] = work(index)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]
    assert all(len(r) == 200 and all(r) for r in results)
    assert cf(x, y).tolist() == expected and cf(x2, y2).tolist() == expected2
    assert len(list(cf.traces())) == 2  # one graphkern trace per signature, whatever the threads


def norm_and_rows(x: mx.array, w: mx.array) -> Any:
    """A function whose output structure follows the input's rank, as MLX functions with Python
    control flow on shapes do: one array, a pair, or a dict."""
    y = gkk.rms_norm(x, w)
    if x.ndim == 1:
        return y
    if x.ndim == 2:
        return y, y.sum(axis=-1)
    return {"y": y, "rows": y.sum(axis=-1), "total": y.sum()}


def steady_race_setup() -> tuple[gk.CompiledGraph, dict[str, tuple[mx.array, mx.array]], dict[str, Any]]:
    """A compiled ``norm_and_rows`` on its steady path (primed with a 1-D input on this thread),
    each thread's arguments (a new signature each, with another output structure), and the
    eager results they must get."""
    w = mx.linspace(0.5, 1.5, N)
    x0 = mx.arange(N, dtype=mx.float32) / 7
    calls = {"first": (mx.arange(2 * N, dtype=mx.float32).reshape(2, N) / 5 - 1, w),
             "second": (mx.arange(6 * N, dtype=mx.float32).reshape(3, 2, N) / 11 + 0.5, w)}
    mx.eval(w, x0, calls)
    cf = gk.compile(norm_and_rows)
    primed = cf(x0, w)  # the long way: traced, compiled, run; the next call may be a steady one
    assert primed.tolist() == norm_and_rows(x0, w).tolist()
    assert cf.stats()["steady"]
    expected = {name: tree_map(lambda a: a.tolist(), norm_and_rows(*args)) for name, args in calls.items()}
    return cf, calls, expected


def race_two_steady_calls(cf: gk.CompiledGraph, calls: dict[str, tuple[mx.array, mx.array]],
                          monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[str]]:
    """Threads ``first`` and ``second`` call ``cf`` from its steady path at once, each with its
    own ``calls`` arguments, on a forced schedule: each call makes MLX trace (a signature new to
    ``cf``, on a thread new to MLX's per-thread compile cache), which runs ``_run_unseen``; both
    threads finish it (each has written what its trace left: ``_Unseen.TRACED``) before either
    reads it back; then ``first`` reads it, resets it and finishes its whole call before
    ``second`` reads it. One call state shared by the threads would hand ``second`` the state
    ``first`` reset. Returns each thread's result (arrays as lists, or the exception raised)
    and whatever kept the schedule from happening."""
    traced = threading.Barrier(2, timeout=60)
    first_done = threading.Event()
    broken: list[str] = []
    run_unseen = cf._run_unseen

    def run_unseen_then_wait(arrays: tuple[mx.array, ...]) -> list[mx.array]:
        outputs = run_unseen(arrays)
        # still inside MLX's trace, where nothing may raise: a broken schedule is recorded
        name = threading.current_thread().name
        try:
            traced.wait()
        except threading.BrokenBarrierError:
            broken.append(f"{name}: the other thread never reached MLX's trace of its steady call")
        if name == "second" and not first_done.wait(60):
            broken.append("second: the first thread's call never returned")
        return outputs

    outcomes: dict[str, Any] = {}

    def target(name: str) -> None:
        try:
            outcomes[name] = tree_map(lambda a: a.tolist(), cf(*calls[name]))
        except Exception as exc:  # compared by the test
            outcomes[name] = exc
        finally:
            if name == "first":
                first_done.set()

    threads = [threading.Thread(target=target, args=(name,), name=name) for name in calls]
    with monkeypatch.context() as patch:
        patch.setattr(cf, "_run_unseen", run_unseen_then_wait)
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return outcomes, broken


def test_two_threads_inside_the_steady_path_at_once_keep_their_own_call_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads are held inside their steady calls at the point where one would read what
    the other's MLX trace left (``_CallState.unseen``): each still gets its own signature's
    result, in its own output structure, and the compiled graph serves all three signatures
    correctly afterwards."""
    cf, calls, expected = steady_race_setup()
    outcomes, broken = race_two_steady_calls(cf, calls, monkeypatch)
    assert not broken, broken
    assert outcomes == expected
    assert isinstance(outcomes["first"], tuple) and isinstance(outcomes["second"], dict)
    for name, args in calls.items():
        assert tree_map(lambda a: a.tolist(), cf(*args)) == expected[name]
    assert len(list(cf.traces())) == 3  # one graphkern trace per signature


def test_the_steady_path_race_mixes_results_when_threads_share_one_call_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The schedule above does reach the point it is meant to: with one call state object for
    both threads instead of ``_CallState``'s per-thread one, ``second`` finds the state
    ``first`` reset, takes its trace's arrays for a steady call's outputs and rebuilds them in
    the primed signature's structure: its own ``y``, bare, instead of its dict."""
    cf, calls, expected = steady_race_setup()
    # _CallState's fields with their defaults, on one object every thread sees
    fields = {k: v for k, v in vars(_CallState).items() if not k.startswith("_")}
    monkeypatch.setattr(cf, "_call_state", types.SimpleNamespace(**fields, recorder=_PassThrough()))
    outcomes, broken = race_two_steady_calls(cf, calls, monkeypatch)
    assert not broken, broken
    assert outcomes["first"] == expected["first"]
    assert outcomes["second"] != expected["second"]
    assert outcomes["second"] == expected["second"]["y"]


def test_fused_ops_as_nodes_is_counted_across_threads_and_restored_once() -> None:
    """``fused_ops_as_nodes`` patches ``mx.fast`` process-wide, as the module hooks patch classes: a
    thread leaving while another is inside leaves the patch in place for it, nested uses are
    counted, and the originals come back once, when the last use ends (without the count, a thread
    entering while another is inside saved that one's patch as the original and put it back)."""
    from graphkern.models.launch_count import _FusedFronts, fused_ops_as_nodes

    stock = {name: getattr(mx.fast, name) for name in ("rms_norm", "layer_norm", "rope")}
    both_inside, first_left = threading.Barrier(2), threading.Event()
    seen: list[Any] = []

    def early() -> None:
        with fused_ops_as_nodes():
            both_inside.wait(timeout=60)
        first_left.set()

    def late() -> None:
        with fused_ops_as_nodes():
            both_inside.wait(timeout=60)
            first_left.wait(timeout=60)
            seen.append(mx.fast.rms_norm is not stock["rms_norm"])
            graph = gk.trace(lambda x, w: mx.fast.rms_norm(x, w, 1e-5), mx.ones((2, 4)), mx.ones((4,)))
            seen.append([graph.node(n)["kernel"] for n in graph.kernels()])

    def churn() -> None:
        for _ in range(200):
            with fused_ops_as_nodes(), fused_ops_as_nodes():
                pass

    threads = [threading.Thread(target=work) for work in (early, late, *[churn] * 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert seen == [True, ["mx_fast_rms_norm"]]
    assert {name: getattr(mx.fast, name) for name in stock} == stock
    assert not _FusedFronts.places
