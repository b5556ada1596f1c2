"""The ``trace``, ``show``, ``diff`` and ``view`` commands of the ``graphkern`` command line.

``graphkern.cli`` (the click group ``main``, with ``demo``) calls ``register(main)``. Exit status:
0 when all is well, 1 when the graph has a failed node (``trace``, ``show``), when tracing raised,
or when ``diff`` found differences; 2 for bad input — a corrupt, truncated or unknown-version JSON
file, a module or callable that cannot be found, a bad ``--input`` spec, an output folder that
does not exist or is read-only, a missing optional tool, an output file that exists (without
``--force``) or that is an input of the command. Output files are all computed first and then each
written to a temporary file and renamed, so a failure never leaves half a file behind
(``graphkern.cli.files``).
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click

from graphkern.cli.errors import EXIT_FAILED, BadInput, failing_as
from graphkern.cli.files import IMAGE_OPTIONS, check_outputs, write_files, writes_files
from graphkern.cli.model import check_model_options, model_and_tokens, model_options

#: Past this many lines (diff) or nodes (show), print a summary; ``--full`` prints everything.
SUMMARY_LINES = 60

# ----------------------------------------------------------------------------- input specs

_DIM_SPLIT = re.compile(r"[,x×\s]+")

#: MLX's shapes are 32-bit signed integers.
MAX_DIMENSION = 2**31 - 1

#: ``mx.random.key`` takes an unsigned 64-bit seed.
MAX_SEED = 2**64 - 1


def check_seed(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """``--seed``'s callback: a seed ``mx.random.key`` takes."""
    if not 0 <= value <= MAX_SEED:
        raise BadInput(f"--seed {value}: give a whole number from 0 to {MAX_SEED}")
    return value


SEED_OPTION = click.option("--seed", default=0, show_default=True, type=int, callback=check_seed,
                           help="Random seed for the inputs (0 to 2**64-1).")


def parse_input_spec(spec: str) -> tuple[tuple[int, ...], str]:
    """``"4,8:float32"`` -> ``((4, 8), "float32")``.

    The shape is comma- or x-separated (``4,8``, ``4x8``, ``(4, 8)``, ``[4,8]``); ``()``,
    ``scalar`` or nothing before the colon is a scalar; the dtype defaults to float32.

    >>> parse_input_spec("4,8:float16"), parse_input_spec("2x3"), parse_input_spec("():int32")
    (((4, 8), 'float16'), ((2, 3), 'float32'), ((), 'int32'))
    """
    from graphkern.nodes import dtype_from_name

    text = spec.strip()
    shape_text, _, dtype = text.partition(":")
    dtype = dtype.strip() or "float32"
    try:
        dtype_from_name(dtype)
    except KeyError:
        raise BadInput(f"bad --input {spec!r}: unknown dtype {dtype!r} (use e.g. float32, "
                       "float16, bfloat16, int32, uint32, bool)") from None
    shape_text = shape_text.strip().strip("()[]").strip()
    if shape_text.lower() in ("", "scalar"):
        return (), dtype
    dims = []
    for part in _DIM_SPLIT.split(shape_text):
        if not part:
            continue
        if not part.isdigit():
            raise BadInput(f"bad --input {spec!r}: dimension {part!r} is not a non-negative "
                           "integer (expected SHAPE:DTYPE such as 4,8:float32)")
        if int(part) > MAX_DIMENSION:
            raise BadInput(f"bad --input {spec!r}: dimension {part} is larger than MLX takes "
                           f"(at most {MAX_DIMENSION})")
        dims.append(int(part))
    return tuple(dims), dtype


def make_input(shape: tuple[int, ...], dtype: str, key: Any) -> Any:
    """A random array for one ``--input``: normal floats (complex64: a normal real part),
    integers in [0, 16), random bools."""
    import mlx.core as mx

    from graphkern.nodes import dtype_from_name

    dt = dtype_from_name(dtype)
    if dt == mx.bool_:
        return mx.random.bernoulli(0.5, shape, key=key)
    if mx.issubdtype(dt, mx.integer):
        return mx.random.randint(0, 16, shape, key=key).astype(dt)
    return mx.random.normal(shape, key=key).astype(dt)


# ----------------------------------------------------------------------------- targets


def resolve_target(target: str) -> tuple[Callable[..., Any], str]:
    """``"package.module:Class.method"`` or ``"path/to/file.py:fn"`` -> (callable, name).

    A class is instantiated with no arguments first (an ``nn.Module`` subclass, say).
    """
    import importlib
    import importlib.util

    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise BadInput(f"bad target {target!r}: expected MODULE:CALLABLE, e.g. mypkg.model:forward "
                       "or path/to/model.py:forward")
    try:
        if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                raise BadInput(f"cannot import {module_name!r}: no such file")
            name = os.path.splitext(os.path.basename(path))[0]
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise BadInput(f"cannot import {module_name!r}: not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(path))
            try:
                sys.modules[name] = module
                spec.loader.exec_module(module)
            finally:
                sys.path.remove(os.path.dirname(path))
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except BadInput:
        raise
    except ModuleNotFoundError as e:
        raise BadInput(f"cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # the module itself raised while importing
        raise BadInput(f"importing {module_name!r} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"module {module_name!r} has no callable {attr!r} "
                           f"({type(obj).__name__} has no attribute {part!r})")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:
            raise BadInput(f"{attr!r} is a class and calling it with no arguments raised "
                           f"{type(e).__name__}: {e}") from None
    if not callable(obj):
        raise BadInput(f"{module_name}:{attr} is a {type(obj).__name__}, not a callable")
    return obj, attr


def check_arity(fn: Callable[..., Any], target: str, given: int) -> None:
    """Refuse, saying what to fix, a callable whose required positional arguments do not match
    the ``-i`` options given (a missing ``-i``, or a factory function named instead of the model
    it builds)."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in signature.parameters.values())
    if given < len(required):
        names, example = ", ".join(required), " ".join(["-i 1,16:int32"] * len(required))
        raise BadInput(f"{target} takes {len(required)} argument{'s' if len(required) != 1 else ''} "
                       f"({names}) and {given} -i/--input {'was' if given == 1 else 'were'} given: "
                       f"give one -i SHAPE:DTYPE for each, e.g. {example} "
                       "(or use --model PATH for an mlx-lm checkpoint)")
    if given > len(positional) and not varargs:
        if not positional:
            raise BadInput(f"{target} takes no arguments but {given} -i/--input "
                           f"{'was' if given == 1 else 'were'} given. If it builds and returns the "
                           "model, name the model instead: a module-level instance (file.py:model) "
                           "or its class (file.py:MyModel, instantiated with no arguments)")
        raise BadInput(f"{target} takes at most {len(positional)} positional argument"
                       f"{'s' if len(positional) != 1 else ''} and {given} -i/--input were given")


# ----------------------------------------------------------------------------- graphs and files


def load_graph(path: str) -> Any:
    """A ``gk.Graph`` from a JSON file written by ``Graph.to_json``, linted as it loads (every field
    and the graph's structure, ``Graph.from_json``); a file that cannot be read or loaded is one
    ``error:`` line and exit status 2."""
    from graphkern import Graph, KernelError

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return Graph.from_json(data)
    except KernelError as e:
        raise BadInput(f"cannot load {path}: {e.description}") from None
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot load {path}: {type(e).__name__}: {e}") from None


def merge_graphs(paths: tuple[str, ...]) -> Any:
    """The graphs of a job's ranks, one file each, as one graph (``graphkern.distributed.merge``)."""
    from graphkern import KernelError
    from graphkern.distributed import merge

    try:
        return merge([load_graph(path) for path in paths])
    except KernelError as e:
        raise BadInput(f"cannot merge {', '.join(paths)}: {e.description}") from None


@dataclass(frozen=True)
class Drawing:
    """How the pictures are drawn (the drawing options of trace and show)."""

    depth: int | None = None      # modules open to this depth (None: the viewer's one box per
                                  # layer; Graphviz closes modules only when the picture is big)
    weights: bool = False         # weights and constants as nodes, not attributes
    repeats: bool = True          # Graphviz: identical repeated blocks drawn once


def render_outputs(graph: Any, outputs: dict[str, str | None],
                   progress: Callable[[str], None] | None = None,
                   drawing: Drawing = Drawing()) -> dict[str, bytes]:
    """Every requested file's content, computed before anything is written."""
    import json

    files: dict[str, bytes] = {}
    dot_options = {"weights": drawing.weights, "repeats": drawing.repeats,
                   "depth": "auto" if drawing.depth is None else drawing.depth}
    for option, path in outputs.items():
        if not path:
            continue
        if progress:
            progress(f"{option.lstrip('-')} -> {path}")
        if option == "--json":
            files[path] = graph.to_json(indent=1).encode()
        elif option == "--html":
            from graphkern.viz.html import to_html

            files[path] = to_html(graph, collapse_depth=drawing.depth,
                                  show_weights=drawing.weights).encode()
        elif option == "--dot":
            from graphkern.viz.dot import to_dot

            files[path] = to_dot(graph, **dot_options).encode()  # type: ignore[arg-type]
        elif option in IMAGE_OPTIONS:
            from graphkern.viz.dot import DotError, run_dot, to_dot

            try:
                files[path] = run_dot(to_dot(graph, **dot_options), option[2:],  # type: ignore[arg-type]
                                       progress=progress, what=path)
            except DotError as e:
                raise BadInput(str(e)) from None
        elif option == "--model-explorer":
            from graphkern.viz.model_explorer import to_model_explorer

            files[path] = json.dumps(to_model_explorer(graph), separators=(",", ":")).encode()
    return files


def brief_summary(graph: Any) -> str:
    """Name, counts by kind, kernels and status in a few lines."""
    from graphkern.viz.common import failures, status_name

    g = graph.nx
    kinds: dict[str, int] = {}
    for _, d in g.nodes(data=True):
        kinds[d.get("kind", "op")] = kinds.get(d.get("kind", "op"), 0) + 1
    counts = ", ".join(f"{v} {k}{'s' if v != 1 else ''}" for k, v in sorted(kinds.items()))
    lines = [f"graph {g.graph.get('name', 'graph')}: {g.number_of_nodes()} nodes ({counts}), "
             f"{g.number_of_edges()} edges, backend {g.graph.get('backend', '?')}"]
    kernels = sorted({str(d.get("kernel") or d.get("label")) for _, d in g.nodes(data=True)
                      if d.get("kind") == "kernel"})
    if kernels:
        from graphkern.kernels.registry import in_words

        lines.append(f"kernels: {', '.join(kernels)}")
        width = max(len(k) for k in kernels)
        lines += [f"  {k:<{width}}  {in_words(k)}" for k in kernels if in_words(k)]
    fails = failures(g)
    if not fails:
        lines.append("status: OK")
    for f in fails:
        lines.append(f"FAILED: {f.node}{' in ' + f.scope if f.scope else ''}: {status_name(f.status)}"
                     + (f": {f.message.splitlines()[0]}" if f.message else "")
                     + f" ({f.affected} node{'s' if f.affected != 1 else ''} downstream)")
    return "\n".join(lines)


@contextmanager
def progress_steps(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A rich spinner with elapsed time on stderr (only on a terminal); yields ``step(text)``."""
    if not enabled:
        yield lambda text: None
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda text: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda text: bar.update(task, description=text)


_OUTPUT_OPTIONS = [
    click.option("--html", "html", type=click.Path(dir_okay=False),
                 help="Write the interactive HTML viewer."),
    click.option("--dot", "dot", type=click.Path(dir_okay=False), help="Write Graphviz DOT."),
    click.option("--svg", "svg", type=click.Path(dir_okay=False), help="Render SVG with Graphviz."),
    click.option("--png", "png", type=click.Path(dir_okay=False), help="Render PNG with Graphviz."),
    click.option("--pdf", "pdf", type=click.Path(dir_okay=False), help="Render PDF with Graphviz."),
    click.option("--model-explorer", "me", type=click.Path(dir_okay=False),
                 help="Write Model Explorer graph JSON."),
    click.option("--depth", type=click.IntRange(min=-1), default=None,
                 help="Open modules to this depth in the pictures (-1: all; default: one box per "
                      "repeated layer in the viewer, Graphviz closes modules only for big graphs)."),
    click.option("--weights", is_flag=True,
                 help="Draw weights and constants as nodes, not as attributes of their readers."),
    click.option("--all-blocks", is_flag=True,
                 help="Graphviz: draw every repeated block, not one with its count."),
]


def _with_outputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_OUTPUT_OPTIONS):
        fn = option(fn)
    return fn


def _drawing(depth: int | None, weights: bool, all_blocks: bool) -> Drawing:
    return Drawing(depth=depth, weights=weights, repeats=not all_blocks)


def _finish(graph: Any, files: dict[str, bytes], quiet: bool) -> None:
    write_files(files)
    if not quiet:
        for path in files:
            click.echo(f"wrote {path}", err=True)
    if int(graph.status) != 0:
        raise SystemExit(EXIT_FAILED)


# ----------------------------------------------------------------------------- commands


@click.command("trace")
@click.argument("target", metavar="[MODULE:CALLABLE]", required=False)
@model_options
@click.option("--input", "-i", "inputs", multiple=True, metavar="SHAPE:DTYPE",
              help="One positional argument, e.g. 4,8:float32 (repeat for each argument; "
                   "integers are drawn from [0, 16), floats from a normal distribution).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the graph as JSON.")
@_with_outputs
@writes_files("target", "model_path")
@SEED_OPTION
@click.option("--backend", type=click.Choice(["metal", "cuda", "reference"]),
              help="Trace for this backend (default: the active one; sets GRAPHKERN_BACKEND).")
@click.option("--table", is_flag=True, help="Print the per-node table, not just the summary.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
def trace_cmd(target: str | None, model_path: str | None, prompt: str | None, token_ids: str | None,
              patch_model: bool, inputs: tuple[str, ...], json_path: str | None, html: str | None,
              dot: str | None, svg: str | None, png: str | None, pdf: str | None, me: str | None,
              depth: int | None, weights: bool, all_blocks: bool, seed: int,
              backend: str | None, table: bool, quiet: bool) -> None:
    """Trace a model checkpoint on a prompt (--model), or MODULE:CALLABLE on random inputs, and
    write its graph.

    \b
    Examples:
      graphkern trace --model mlx-community/Llama-3.2-1B-Instruct-4bit --prompt hi --html graph.html
      graphkern trace --model ./my-checkpoint --patch --svg patched.svg --json patched.json
      graphkern trace mymodel.py:forward -i 1,16:int32 --html graph.html --json graph.json
      graphkern trace mypkg.layers:RMSNorm -i 4,64:float16 --svg norm.svg

    Exit status: 0 OK, 1 a node failed (or the function raised), 2 bad input.
    """
    check_model_options(target, model_path, prompt, patch_model, inputs, token_ids=token_ids)
    specs = [parse_input_spec(s) for s in inputs]
    outputs = {"--json": json_path, "--html": html, "--dot": dot, "--svg": svg, "--png": png,
               "--pdf": pdf, "--model-explorer": me}
    check_outputs(outputs)
    if backend:
        os.environ["GRAPHKERN_BACKEND"] = backend
    with progress_steps(not quiet) as step:
        call = traced_call(target, model_path, prompt, patch_model, specs, seed, step, quiet,
                           token_ids=token_ids)
        import graphkern as gk

        step(f"tracing {call.name}")
        t0 = time.perf_counter()
        with failing_as(f"tracing {call.label}", f"tracing {call.label} failed: "):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", gk.ScopeWarning)
                graph = gk.trace(call.fn, *call.args)
            for w in caught:  # a plain line, not Python's file:line form
                if issubclass(w.category, gk.ScopeWarning):
                    click.echo(f"warning: {w.message}", err=True)
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elapsed = time.perf_counter() - t0
        if model_path:
            graph.nx.graph["name"] = call.name  # the checkpoint's folder, not its class
        files = render_outputs(graph, outputs, step, _drawing(depth, weights, all_blocks))
    if not quiet:
        click.echo(graph.summary() if table else brief_summary(graph))
        click.echo(f"traced in {elapsed:.2f} s", err=True)
    _finish(graph, files, quiet)


@dataclass
class Call:
    """What a command runs: ``fn(*args)``; ``label`` names it in messages, ``name`` in the graph;
    ``run`` is the loaded checkpoint with ``--model``."""

    label: str
    fn: Callable[..., Any]
    name: str
    args: list[Any]
    run: Any = None


def traced_call(target: str | None, model_path: str | None, prompt: str | None, patch_model: bool,
                specs: list[tuple[tuple[int, ...], str]], seed: int, step: Callable[[str], None],
                quiet: bool = False, stock_twin: bool = False, token_ids: str | None = None) -> Call:
    """The call of ``--model`` (the loaded checkpoint on the prompt's tokens, or on ``--tokens``)
    or of MODULE:CALLABLE (on random inputs from ``specs``)."""
    if model_path:
        run = model_and_tokens(model_path, prompt, patch_model, step, stock_twin, token_ids)
        if not quiet:
            click.echo(run.describe(), err=True)
        return Call(model_path, run.checkpoint.model, run.checkpoint.name, [run.tokens], run)
    assert target is not None  # check_model_options
    fn, name = resolve_target(target)
    check_arity(fn, target, len(specs))
    step(f"building {len(specs)} input{'s' if len(specs) != 1 else ''}")
    import mlx.core as mx

    keys = mx.random.split(mx.random.key(seed), max(2, len(specs)))
    args = [make_input(shape, dtype, keys[i]) for i, (shape, dtype) in enumerate(specs)]
    return Call(target, fn, name, args)


@click.command("show")
@click.argument("files", metavar="FILE.json...", nargs=-1, required=True,
                type=click.Path(dir_okay=False))
@_with_outputs
@writes_files("files")
@click.option("--brief", is_flag=True, help="Print the summary lines only, not the per-node table.")
@click.option("--full", is_flag=True,
              help=f"Print the per-node table whatever its size (by default up to {SUMMARY_LINES} nodes).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
def show_cmd(files: tuple[str, ...], html: str | None, dot: str | None, svg: str | None,
             png: str | None, pdf: str | None, me: str | None, depth: int | None, weights: bool,
             all_blocks: bool, brief: bool, full: bool, quiet: bool) -> None:
    """Print a saved graph (from --json or Graph.to_json) and convert it to other formats.

    Several files are the graphs of a distributed job's ranks, one each: they are merged into one
    graph, a lane per rank, collectives linked across ranks, and a rank's failure marked wherever
    it reaches on every rank.

    \b
    Examples:
      graphkern show graph.json --html graph.html --svg graph.svg
      graphkern show rank0.json rank1.json --html job.html

    Exit status: 0 OK, 1 the graph has a failed node, 2 a file cannot be read.
    """
    outputs = {"--html": html, "--dot": dot, "--svg": svg, "--png": png, "--pdf": pdf,
               "--model-explorer": me}
    check_outputs(outputs)
    graph = load_graph(files[0]) if len(files) == 1 else merge_graphs(files)
    with progress_steps(not quiet) as step:
        written = render_outputs(graph, outputs, step, _drawing(depth, weights, all_blocks))
    if not quiet:
        click.echo(brief_summary(graph))
        nodes = graph.nx.number_of_nodes()
        if full or (not brief and nodes <= SUMMARY_LINES):
            click.echo(graph.summary())
        elif not brief:
            click.echo(f"({nodes} nodes: --full prints the per-node table)")
    _finish(graph, written, quiet)


@click.command("diff")
@click.argument("before", metavar="A.json", type=click.Path(dir_okay=False))
@click.argument("after", metavar="B.json", type=click.Path(dir_okay=False))
@click.option("--html", type=click.Path(dir_okay=False),
              help="Write B in the HTML viewer with the differences marked.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write the differences as JSON.")
@writes_files("before", "after")
@click.option("--depth", type=click.IntRange(min=-1), default=None,
              help="Open modules to this depth in the HTML page (-1: all).")
@click.option("--weights", is_flag=True, help="Draw weights and constants as nodes in the HTML page.")
@click.option("--full", is_flag=True,
              help=f"Print every node that differs (by default, past {SUMMARY_LINES} lines, the "
                   "counts by module).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing; use the exit status.")
def diff_cmd(before: str, after: str, html: str | None, json_path: str | None,
             depth: int | None, weights: bool, full: bool, quiet: bool) -> None:
    """Compare two saved graphs: nodes and kernels added, removed or changed.

    \b
    Example:
      graphkern diff before.json after.json --html diff.html

    Exit status: 0 no differences, 1 differences, 2 a file cannot be read.
    """
    import json

    from graphkern.viz.graph_diff import diff

    check_outputs({"--html": html, "--json": json_path})
    a, b = load_graph(before), load_graph(after)
    d = diff(a, b)
    files: dict[str, bytes] = {}
    if html:
        files[html] = d.to_html(collapse_depth=depth, show_weights=weights).encode()
    if json_path:
        files[json_path] = json.dumps(d.to_dict(), indent=1).encode()
    write_files(files)
    if not quiet:
        click.echo(str(d) if full else d.summary(SUMMARY_LINES))
        for path in files:
            click.echo(f"wrote {path}", err=True)
    raise SystemExit(EXIT_FAILED if d else 0)


@click.command("view")
@click.argument("file", metavar="[FILE.json]", type=click.Path(dir_okay=False), required=False)
@model_options
@click.option("--model-explorer", "model_explorer", is_flag=True,
              help="Open in Google's Model Explorer (pip install 'graphkern[model-explorer]').")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Where to write the HTML page (default: a new temporary folder).")
@writes_files("file", "model_path")
@click.option("--no-browser", is_flag=True, help="Write the page (or start the server) but open no browser.")
@click.option("--port", default=8080, show_default=True, help="Model Explorer's port.")
def view_cmd(file: str | None, model_path: str | None, prompt: str | None, token_ids: str | None,
             patch_model: bool, model_explorer: bool, out: str | None, no_browser: bool, port: int) -> None:
    """Open a saved graph, or a model checkpoint traced on a prompt (--model), in the browser (the
    HTML viewer, or Model Explorer).

    \b
    Examples:
      graphkern view --model mlx-community/Llama-3.2-1B-Instruct-4bit --patch
      graphkern view graph.json
      graphkern view graph.json --model-explorer
    """
    check_model_options(file, model_path, prompt, patch_model, what="FILE.json", token_ids=token_ids)
    if model_explorer:
        import importlib.util

        from graphkern.viz.model_explorer import INSTALL_HINT

        if importlib.util.find_spec("model_explorer") is None:
            raise BadInput(INSTALL_HINT)
        graph = _viewed_graph(file, model_path, prompt, patch_model, token_ids)
        from graphkern.viz.model_explorer import view

        view(graph, port=port, open_browser=not no_browser)
        return
    import tempfile
    import webbrowser

    from graphkern.viz.html import to_html

    check_outputs({"--out": out})
    graph = _viewed_graph(file, model_path, prompt, patch_model, token_ids)
    if out is None:
        out = os.path.join(tempfile.mkdtemp(prefix="graphkern-"), "graph.html")
    write_files({out: to_html(graph).encode()})
    click.echo(f"wrote {out}")
    if not no_browser:
        webbrowser.open("file://" + os.path.abspath(out))


def _viewed_graph(file: str | None, model_path: str | None, prompt: str | None, patch_model: bool,
                  token_ids: str | None = None) -> Any:
    """The saved graph in ``file``, or the trace of ``--model`` on its prompt (or ``--tokens``)."""
    if file:
        return load_graph(file)
    assert model_path is not None  # check_model_options
    import graphkern as gk

    call = traced_call(None, model_path, prompt, patch_model, [], 0, lambda text: None,
                       token_ids=token_ids)
    try:
        graph = gk.trace(call.fn, *call.args)
    except gk.KernelError as e:
        click.echo(f"error: tracing {call.label} failed: {e}", err=True)
        raise SystemExit(EXIT_FAILED) from None
    graph.nx.graph["name"] = call.name
    return graph


COMMANDS = [trace_cmd, show_cmd, diff_cmd, view_cmd]


def register(group: click.Group) -> None:
    """Add ``trace``, ``show``, ``diff`` and ``view`` to the ``graphkern`` group."""
    for command in COMMANDS:
        if command.name not in group.commands:
            group.add_command(command)
