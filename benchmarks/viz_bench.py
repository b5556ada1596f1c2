"""Drawing benchmarks on a 10,000-node graph; prints raw figures (milliseconds).

Budgets: first render in headless Chromium <= 3 s; JSON and Model Explorer export
<= 1 s each; DOT <= 1 s (Graphviz's own rendering excluded).

    python benchmarks/viz_bench.py [--nodes 10000] [--repeat 5] [--no-browser]

The graph is tests/viz_graphs.py's transformer-like trace (about 60 nodes per block, nested module
scopes, one failed kernel half-way so that a third of the graph is UPSTREAM_FAILED), wrapped in
``gk.Graph`` so the JSON export is the real ``Graph.to_json``. The browser is Debian's Chromium
driven by playwright (``$GRAPHKERN_CHROMIUM`` overrides the path); "first render" is
``performance.now()`` when the viewer has parsed the data, laid the graph out and drawn its first
frame, i.e. the time from navigation start to a usable picture.
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import viz_graphs  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.viz.dot import to_dot  # noqa: E402
from graphkern.viz.html import to_html  # noqa: E402
from graphkern.viz.model_explorer import to_model_explorer  # noqa: E402

CPU: dict[str, list[float]] = {}


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
    print(f"{name:<46} median {med:7.1f} ms  min {min(times):7.1f}  max {max(times):7.1f}"
          + (f"  cpu {statistics.median(cpu):7.1f}" if cpu else "")
          + f"  n={len(times)}" + (f"  budget {budget_ms:.0f} ms {verdict}" if budget_ms else "")
          + (f"  {extra}" if extra else ""), flush=True)
    return {"name": name, "median_ms": med, "min_ms": min(times), "max_ms": max(times),
            "cpu_median_ms": statistics.median(cpu) if cpu else None,
            "n": len(times), "budget_ms": budget_ms, "raw_ms": [round(t, 1) for t in times]}


def browser_runs(page_path: Path, repeat: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("GRAPHKERN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    out: dict[str, list[float]] = {"first": [], "wall": [], "layout": [], "script": [], "redraw": [],
                                   "redraw_close": [], "relayout": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for _ in range(repeat):
            page = browser.new_page(viewport={"width": 1400, "height": 900})
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
            # one frame of the whole graph zoomed out, and a collapse/expand round trip
            out["redraw"].append(page.evaluate("""() => { gk.collapseToDepth(-1); gk.fitAll();
                const t = performance.now(); for (let i = 0; i < 5; i++) gk.redraw();
                return (performance.now() - t) / 5; }"""))
            out["redraw_close"].append(page.evaluate("""() => { gk.focus('output_0');
                const t = performance.now(); for (let i = 0; i < 5; i++) gk.redraw();
                return (performance.now() - t) / 5; }"""))
            out["relayout"].append(page.evaluate("""() => { const t = performance.now();
                gk.collapseToDepth(1); gk.collapseToDepth(-1); return (performance.now() - t) / 2; }"""))
            if errors:
                raise SystemExit(f"page errors: {errors}")
            page.close()
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()

    fake = viz_graphs.big(args.nodes)
    graph = gk.Graph(fake.nx)
    n, m = graph.nx.number_of_nodes(), graph.nx.number_of_edges()
    print(f"graph: {n} nodes, {m} edges, {len(graph.kernels())} kernels, status {graph.status.name}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f} (wall times include waiting for a CPU; "
          "cpu = this process's CPU time)")
    results = []
    times, text = timed(lambda: graph.to_json(), args.repeat)
    results.append(row("JSON export (Graph.to_json)", times, 1000, f"{len(text) / 1e6:.1f} MB"))
    times, _ = timed(lambda: gk.Graph.from_json(text), args.repeat)
    results.append(row("JSON load (Graph.from_json)", times, None))
    times, me = timed(lambda: json.dumps(to_model_explorer(graph), separators=(",", ":")), args.repeat)
    results.append(row("Model Explorer export (+ json.dumps)", times, 1000, f"{len(me) / 1e6:.1f} MB"))
    times, dot = timed(lambda: to_dot(graph), args.repeat)
    results.append(row("DOT (no Graphviz rendering)", times, 1000, f"{len(dot) / 1e6:.1f} MB"))
    times, page = timed(lambda: to_html(graph), args.repeat)
    results.append(row("HTML page generation (Python)", times, None, f"{len(page) / 1e6:.1f} MB"))
    if not args.no_browser:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "big.html"
            path.write_text(page)
            runs = browser_runs(path, args.repeat)
        results.append(row("Chromium first render (navigation->drawn)", runs["first"], 3000))
        results.append(row("  of which viewer script (parse+layout+draw)", runs["script"], None))
        results.append(row("  of which layout", runs["layout"], None))
        results.append(row("Chromium wall time goto->ready (playwright)", runs["wall"], None))
        results.append(row("redraw, all 10k nodes in view", runs["redraw"], None))
        results.append(row("redraw, zoomed in (labels, edge labels)", runs["redraw_close"], None))
        results.append(row("collapse/expand all + relayout", runs["relayout"], None))
    if args.json:
        Path(args.json).write_text(json.dumps({"nodes": n, "edges": m, "results": results}, indent=1))


if __name__ == "__main__":
    main()
