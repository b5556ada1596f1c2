"""Drawing benchmarks: a 10,000-node graph and real traced mlx-lm llamas; prints raw figures (ms).

Budgets: first render in headless Chromium of a traced 32-layer llama (and of its gk.inspect
values graph, coloured by abs-max) <= 1 s and of a 10,000-node graph <= 3 s; Graphviz SVG of an
8-layer llama <= 5 s and of a 32-layer one <= 20 s; JSON and Model Explorer export <= 1 s each;
DOT text <= 1 s.

    python benchmarks/viz_bench.py [--nodes 10000] [--layers 8,32] [--repeat 5] [--no-browser]
                                   [--no-graphviz] [--dot-timeout 60] [--json F]

The 10,000-node graph is tests/helpers/viz_graphs.py's transformer-like trace (about 60 nodes per block,
nested module scopes, one failed kernel half-way so that a third of the graph is
UPSTREAM_FAILED), wrapped in ``gk.Graph`` so the JSON export is the real ``Graph.to_json``. The
real models are random-weight mlx-lm llamas (hidden size 64, ``graphkern.models.tiny``'s llama
config with ``num_hidden_layers`` set), ``gk.patch``ed and ``gk.trace``d on eight tokens, and the
same model run through ``gk.inspect`` (statistics on every node: the viewer opens coloured by
abs-max). The
browser is Debian's Chromium driven by playwright (``$GRAPHKERN_CHROMIUM`` overrides the path);
"first render" is ``performance.now()`` when the viewer has parsed the data, laid the graph out
and drawn its first frame, i.e. the time from navigation start to a usable picture, at 1600x1000.
Graphviz figures are ``render()`` end to end (DOT text, ``dot -Tsvg``, the file written), side by
side with the same graph drawn whole: every block (``repeats=False``), weights as nodes too
(``weights=True``), and the DOT the earlier ``to_dot`` wrote (all of that with ``newrank=true``),
stopped after ``--dot-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers")]

import mlx.core as mx  # noqa: E402
import viz_graphs  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.viz.dot import DotError, render, run_dot, to_dot  # noqa: E402
from graphkern.viz.html import to_html  # noqa: E402
from graphkern.viz.model_explorer import to_model_explorer  # noqa: E402

CPU: dict[str, list[float]] = {}
TOKENS = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])   # as viz_graphs.llama traces


def timed(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    """Wall-clock milliseconds of each run; the process CPU time goes to CPU[id(times)]."""
    times: list[float] = []
    cpu: list[float] = []
    out = None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        times.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    CPU[str(id(times))] = cpu
    return times, out


def row(name: str, times: list[float], budget_ms: float | None, extra: str = "") -> dict[str, Any]:
    med = statistics.median(times)
    cpu = CPU.get(str(id(times)))
    verdict = "" if budget_ms is None else ("ok" if med <= budget_ms else "OVER BUDGET")
    print(f"{name:<52} median {med:8.1f} ms  min {min(times):8.1f}  max {max(times):8.1f}"
          + (f"  cpu {statistics.median(cpu):8.1f}" if cpu else "")
          + f"  n={len(times)}" + (f"  budget {budget_ms:.0f} ms {verdict}" if budget_ms else "")
          + (f"  {extra}" if extra else ""), flush=True)
    return {"name": name, "median_ms": med, "min_ms": min(times), "max_ms": max(times),
            "cpu_median_ms": statistics.median(cpu) if cpu else None,
            "n": len(times), "budget_ms": budget_ms, "raw_ms": [round(t, 1) for t in times]}


def chromium() -> str:
    return os.environ.get("GRAPHKERN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


class Browser:
    """One Chromium for every page of the run."""

    def __enter__(self) -> Browser:
        from playwright.sync_api import sync_playwright

        self._p = sync_playwright().start()
        self.browser = self._p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        return self

    def __exit__(self, *exc: Any) -> None:
        self.browser.close()
        self._p.stop()

    def runs(self, html: str, repeat: int, after: dict[str, str]) -> dict[str, list[float]]:
        """First render (and its parts) of each of ``repeat`` fresh loads of the page ``html``,
        then each of ``after``'s expressions, timed in the page (milliseconds)."""
        with tempfile.TemporaryDirectory() as tmp:
            page_path = Path(tmp) / "page.html"
            page_path.write_text(html)
            return self._runs(page_path, repeat, after)

    def _runs(self, page_path: Path, repeat: int, after: dict[str, str]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"first": [], "wall": [], "layout": [], "script": []}
        out.update({k: [] for k in after})
        for _ in range(repeat):
            page = self.browser.new_page(viewport={"width": 1600, "height": 1000})
            errors: list[str] = []

            def on_error(e: Any, errors: list[str] = errors) -> None:
                errors.append(str(e))

            page.on("pageerror", on_error)
            t = time.perf_counter()
            page.goto(page_path.as_uri())
            page.wait_for_function("window.gk && window.gk.ready", timeout=60_000)
            out["wall"].append((time.perf_counter() - t) * 1000)
            first, layout, script = page.evaluate("[gk.firstRenderMs, gk.layoutMs, gk.scriptMs]")
            out["first"].append(first)
            out["layout"].append(layout)
            out["script"].append(script)
            for key, expr in after.items():
                out[key].append(page.evaluate(f"() => {{ const t = performance.now(); {expr}; "
                                              "gk.redraw(); return performance.now() - t; }"))
            if errors:
                raise SystemExit(f"page errors: {errors}")
            page.close()
        return out


def synthetic(args: argparse.Namespace, results: list[dict[str, Any]], browser: Browser | None) -> None:
    fake = viz_graphs.big(args.nodes)
    graph = gk.Graph(fake.nx)
    n, m = graph.nx.number_of_nodes(), graph.nx.number_of_edges()
    print(f"\nsynthetic graph: {n} nodes, {m} edges, {len(graph.kernels())} kernels, "
          f"status {graph.status.name}")
    times, text = timed(lambda: graph.to_json(), args.repeat)
    results.append(row("JSON export (Graph.to_json)", times, 1000, f"{len(text) / 1e6:.1f} MB"))
    times, _ = timed(lambda: gk.Graph.from_json(text), args.repeat)
    results.append(row("JSON load (Graph.from_json)", times, None))
    times, me = timed(lambda: json.dumps(to_model_explorer(graph), separators=(",", ":")), args.repeat)
    results.append(row("Model Explorer export (+ json.dumps)", times, 1000, f"{len(me) / 1e6:.1f} MB"))
    times, dot = timed(lambda: to_dot(graph, weights=True, repeats=False, depth=None), args.repeat)
    results.append(row("DOT text, every node (no Graphviz)", times, 1000, f"{len(dot) / 1e6:.1f} MB"))
    times, page = timed(lambda: to_html(graph), args.repeat)
    results.append(row("HTML page generation (Python)", times, None, f"{len(page) / 1e6:.1f} MB"))
    if browser is None:
        return
    for label, html in (("one box per layer", page),
                        ("every module open", to_html(graph, collapse_depth=-1))):
        runs = browser.runs(html, args.repeat, {
            "redraw": "gk.fitAll()",
            "relayout": "gk.collapseToDepth(-1); gk.collapseToDepth('auto')",
        })
        results.append(row(f"Chromium first render, {n} nodes, {label}", runs["first"], 3000))
        results.append(row("  of which the viewer script (parse+layout+draw)", runs["script"], None))
        results.append(row("  of which the layout", runs["layout"], None))
        results.append(row("  playwright wall time goto -> ready", runs["wall"], None))
        results.append(row("  fit all and redraw", runs["redraw"], None))
        results.append(row("  open every module, then one box per layer", runs["relayout"], None))


def llamas(args: argparse.Namespace, results: list[dict[str, Any]], browser: Browser | None) -> None:
    for layers in args.layers:
        t = time.perf_counter()
        graph = viz_graphs.llama(layers)
        traced = (time.perf_counter() - t) * 1000
        n, m = graph.nx.number_of_nodes(), graph.nx.number_of_edges()
        print(f"\nllama, {layers} layers, patched: {n} nodes, {m} edges, {len(graph.kernels())} kernels "
              f"(built and traced in {traced:.0f} ms)")
        if browser is not None:
            runs = browser.runs(to_html(graph), args.repeat, {
                "open": "gk.expand('model.layers.1')",
                "all": "gk.collapseToDepth(-1)",
            })
            results.append(row(f"Chromium first render, llama {layers} layers", runs["first"],
                               1000 if layers >= 32 else None))
            results.append(row("  of which the layout", runs["layout"], None))
            results.append(row("  open one layer in place (relayout + draw)", runs["open"], None))
            results.append(row("  open every module (relayout + draw)", runs["all"], None))
            values = gk.inspect(viz_graphs.llama_model(layers), TOKENS)
            runs = browser.runs(to_html(values), args.repeat, {
                "nan": "gk.colourBy('nonfinite')",
                "all": "gk.collapseToDepth(-1)",
            })
            results.append(row(f"Chromium first render, llama {layers} layers, inspected (abs-max)",
                               runs["first"], 1000 if layers >= 32 else None))
            results.append(row("  colour by NaN/Inf instead (scale, legend + draw)", runs["nan"], None))
            results.append(row("  open every module, coloured (relayout + draw)", runs["all"], None))
        if args.no_graphviz:
            continue
        budget = 5000 if layers <= 8 else 20000
        with tempfile.TemporaryDirectory() as tmp:
            svg = Path(tmp) / "llama.svg"
            times, _ = timed(lambda g=graph, out=svg: render(g, out, progress=False), args.repeat)
            results.append(row(f"Graphviz SVG, llama {layers} layers (render)", times, budget,
                               f"{svg.stat().st_size / 1e6:.2f} MB"))
        whole = [("  every block drawn (repeats=False)", {"repeats": False}),
                 ("  every block, every module open", {"repeats": False, "depth": None}),
                 ("  ... and weights as nodes", {"repeats": False, "depth": None, "weights": True})]
        for name, options in whole:
            dot = to_dot(graph, **options)
            results.append(_dot_row(name, dot, args))
        old = to_dot(graph, repeats=False, depth=None, weights=True).replace(
            "graph [rankdir=TB,", "graph [rankdir=TB, newrank=true,", 1)
        results.append(_dot_row("  ... with newrank=true (as to_dot wrote before)", old, args))


def _dot_row(name: str, dot: str, args: argparse.Namespace) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        run_dot(dot, "svg", timeout=args.dot_timeout)
    except DotError as e:
        print(f"{name:<52} stopped after {time.perf_counter() - t:.1f} s ({e})", flush=True)
        return {"name": name, "median_ms": None, "stopped_after_s": args.dot_timeout}
    return row(name, [(time.perf_counter() - t) * 1000], None, f"{dot.count(' -> ')} edges")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--no-graphviz", action="store_true")
    ap.add_argument("--dot-timeout", type=float, default=60.0)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f} (wall times include waiting for a CPU; "
          "cpu = this process's CPU time)")
    results: list[dict[str, Any]] = []
    if args.no_browser:
        synthetic(args, results, None)
        llamas(args, results, None)
    else:
        with Browser() as browser:
            synthetic(args, results, browser)
            llamas(args, results, browser)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()
