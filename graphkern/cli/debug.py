"""``graphkern debug``: where a NaN starts, or where two functions part ways, from the shell.

Exit status: 0 when every value is finite (and, with ``--compare``, within tolerance); 1 with the
root-cause node printed (the node where a NaN/Inf started, or the first divergence), or when the
function raised; 2 on bad input (as every ``graphkern`` command).
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from graphkern.cli.commands import (
    EXIT_FAILED,
    SEED_OPTION,
    BadInput,
    check_outputs,
    parse_input_spec,
    progress_steps,
    resolve_target,
    traced_call,
    write_files,
)
from graphkern.cli.errors import failing_as
from graphkern.cli.files import staged_output, writes_files
from graphkern.cli.model import check_model_options, model_options

__all__ = ["debug_cmd", "register"]


def _root_cause_lines(graph: Any, side: str = "") -> list[str]:
    """The lines naming where a NaN/Inf started in ``graph`` (none when all is finite)."""
    from graphkern.nodes import Status

    lines = []
    for failure in graph.failures():
        data = graph.nx.nodes[failure.node]
        where = data.get("scope") or "top level"
        what = data.get("kernel") or data.get("op") or data.get("kind")
        lines.append(f"{side}root cause: {failure.node} ({data['kind']} {what}) in {where}: "
                     f"{failure.status.name}")
        lines.append(f"  {failure.message}")
        if failure.status == Status.NON_FINITE:
            lines.append(f"  reaches: {', '.join(failure.affected_outputs) or 'no outputs'}")
    return lines


def _summary(graph: Any) -> str:
    values = graph.nx.graph.get("values", {})
    line = (f"{graph.nx.graph.get('name')}: {graph.nx.number_of_nodes()} nodes, "
            f"{values.get('nodes', 0)} with values, backend {graph.nx.graph.get('backend')}")
    if values.get("unreached"):
        line += f", {values['unreached']} not reached (values_note on each says why)"
    return line


@click.command("debug")
@click.argument("target", metavar="[MODULE:CALLABLE]", required=False)
@model_options
@click.option("--input", "-i", "inputs", multiple=True, metavar="SHAPE:DTYPE",
              help="One positional argument, e.g. 1,16:int32 (repeat for each argument).")
@click.option("--compare", "other", metavar="MODULE:CALLABLE",
              help="Compare against this function or model, on the same inputs (it is the reference).")
@click.option("--compare-stock", is_flag=True,
              help="With --model --patch: compare the patched model against the stock one (the "
                   "reference, a second model object on the same weights).")
@click.option("--backend", type=click.Choice(["metal", "cuda", "reference"]),
              help="Kernel backend for MODULE:CALLABLE (default: the active one).")
@click.option("--compare-backend", type=click.Choice(["metal", "cuda", "reference"]),
              help="Kernel backend for the --compare side (default: the active one).")
@click.option("--rtol", default=1e-4, show_default=True, help="Relative tolerance of --compare.")
@click.option("--atol", default=1e-5, show_default=True, help="Absolute tolerance of --compare.")
@click.option("--html", type=click.Path(dir_okay=False),
              help="Write the values graph (or, with --compare, the comparison table) as HTML.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write the values graph (or, with --compare, the comparison) as JSON.")
@click.option("--save", type=click.Path(dir_okay=False),
              help="Write every op and kernel node's full output to a .npz or .safetensors file.")
@writes_files("target", "model_path", "other")
@SEED_OPTION
@click.option("--quiet", "-q", is_flag=True, help="Print only the verdict.")
def debug_cmd(target: str | None, model_path: str | None, prompt: str | None, token_ids: str | None,
              patch_model: bool,
              inputs: tuple[str, ...], other: str | None, compare_stock: bool, backend: str | None,
              compare_backend: str | None, rtol: float, atol: float, html: str | None,
              json_path: str | None, save: str | None, seed: int, quiet: bool) -> None:
    """Run a model checkpoint on a prompt (--model), or MODULE:CALLABLE on random inputs, node by
    node: name the node where a NaN or Inf started, or, with --compare (--compare-stock), the first
    node where the two differ beyond tolerance.

    \b
    Examples:
      graphkern debug --model mlx-community/Llama-3.2-1B-Instruct-4bit --prompt hi
      graphkern debug --model ./my-checkpoint --patch --compare-stock --html compare.html
      graphkern debug mymodel.py:forward -i 1,16:int32 --html values.html
      graphkern debug mymodel.py:patched -i 1,16:int32 --compare mymodel.py:stock
      graphkern debug mymodel.py:model -i 1,16:int32 --compare mymodel.py:model --compare-backend reference

    Exit status: 0 all finite (and within tolerance), 1 a root cause was found (printed) or the
    function raised, 2 bad input.
    """
    check_model_options(target, model_path, prompt, patch_model, inputs, token_ids=token_ids)
    specs = [parse_input_spec(s) for s in inputs]
    check_outputs({"--html": html, "--json": json_path, "--save": save})
    if compare_stock and not (model_path and patch_model):
        raise BadInput("--compare-stock compares a patched checkpoint with its stock model: "
                       "give --model PATH --patch")
    if other and model_path:
        raise BadInput("--compare MODULE:CALLABLE goes with MODULE:CALLABLE; with --model use "
                       "--patch --compare-stock")
    if save and (other or compare_stock):
        raise BadInput("--save writes one function's values; leave out --compare")
    if save and os.path.splitext(save)[1].lower() not in (".npz", ".safetensors"):
        raise BadInput(f"--save {save}: the file must end in .npz or .safetensors")
    reference = resolve_target(other)[0] if other else None
    from graphkern.debugging.comparison import compare
    from graphkern.debugging.values import Inspector

    with progress_steps(not quiet) as step:
        call = traced_call(target, model_path, prompt, patch_model, specs, seed, step, quiet,
                           stock_twin=compare_stock, token_ids=token_ids)
    fn, name, args = call.fn, call.name, call.args
    if compare_stock:
        reference, other = call.run.stock, "the stock model"
    # the long part reports its own phases (a bar on a terminal, lines otherwise) on stderr
    result: Any
    with staged_output(save) as save_to, failing_as(f"running {call.label}"):
        if reference is None:
            graph = Inspector(backend=backend, save=save_to, progress=not quiet)(fn, *args)
            result = graph
        else:
            if not quiet:
                click.echo(f"comparing {name} with {other}", err=True)
            result = compare(reference, fn, *args, rtol=rtol, atol=atol,
                             backends=(compare_backend, backend), progress=not quiet)
    if call.run is not None:  # name the graphs after the checkpoint, not its class
        graphs = [result] if reference is None else [result.a, result.b]
        sides = [""] if reference is None else [" stock", " patched"]
        for g, side in zip(graphs, sides):
            g.nx.graph["name"] = call.name + side
    files: dict[str, bytes] = {}
    if reference is None:
        if html:
            files[html] = graph.to_html().encode()
        if json_path:
            files[json_path] = graph.to_json(indent=1).encode()
        lines = _root_cause_lines(graph)
        failed = bool(lines)
        if not quiet:
            click.echo(_summary(graph))
        click.echo("\n".join(lines) if lines else "all values finite")
    else:
        if html:
            files[html] = result.to_html().encode()
        if json_path:
            files[json_path] = json.dumps(result.to_dict(), indent=1).encode()
        lines = _root_cause_lines(result.a, "reference: ") + _root_cause_lines(result.b)
        failed = bool(lines) or not result.ok
        if not quiet:
            click.echo(_summary(result.a))
            click.echo(_summary(result.b))
        click.echo(str(result))
        if lines:
            click.echo("\n".join(lines))
    write_files(files)
    if not quiet:
        for path in files:
            click.echo(f"wrote {path}", err=True)
        if save:
            click.echo(f"wrote {save}", err=True)
    if failed:
        raise SystemExit(EXIT_FAILED)


def register(group: click.Group) -> None:
    """Add ``debug`` to the ``graphkern`` group."""
    if debug_cmd.name not in group.commands:
        group.add_command(debug_cmd)
