"""The ``graphkern`` command line (click). ``graphkern demo`` is the main job.

Other commands (trace, show, diff, view) are registered from ``graphkern.cli.commands``,
``debug`` from ``graphkern.cli.debug``, ``bench`` from ``graphkern.cli.bench`` and ``metal-check``
from ``graphkern.cli.metal``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import click

from .errors import Interrupted
from .files import writes_files


class _Group(click.Group):
    """The ``graphkern`` group: Ctrl-C in any command is exit status 130 with one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphkern")
def main() -> None:
    """graphkern: custom GPU kernels as first-class nodes of MLX compiled graphs.

    Commands that write files replace one that exists only with --force, and never one of their
    own inputs (a file given, a file inside the --model folder) or a read-only file.

    Exit status: 0 all is well, 1 the command found a problem or its run raised (each command's
    help says which), 2 bad input, 130 interrupted (Ctrl-C).
    """


@main.command()
@click.option("--out", "out_dir", default="graphkern-demo", show_default=True,
              type=click.Path(file_okay=False), help="Folder for graph.{json,dot,html} and broken.*.")
@click.option("--no-files", is_flag=True, help="Print only; write nothing.")
@writes_files()
def demo(out_dir: str, no_files: bool) -> None:
    """Trace, compile and break a built-in kernel-backed model, printing what happens. Run again,
    it replaces the files an earlier demo wrote in the same folder (a mark file there says which
    folder that is), and no other file without --force."""
    from ..demo import DEMO_FILES, run_demo
    from .files import check_outputs, make_folder, own_outputs, write_files

    if no_files:
        run_demo(None, echo=click.echo)
        return
    make_folder("--out", out_dir)
    mark = os.path.join(out_dir, DEMO_MARK)
    with own_outputs(mark) as replaced:
        check_outputs([("--out", os.path.join(out_dir, name)) for name in (*DEMO_FILES, DEMO_MARK)])
        if replaced:
            click.echo(f"replacing the files of an earlier demo in {out_dir}", err=True)
        run_demo(out_dir, echo=click.echo, write=lambda files: write_files(
            {path: text.encode() for path, text in files.items()} | {mark: b"graphkern demo\n"}))


#: The file ``graphkern demo`` leaves in its folder, so that a later demo may replace its files.
DEMO_MARK = ".graphkern-demo"


def _register_optional_commands() -> None:
    """Add the commands of ``graphkern.cli.commands`` (``register(main)``) when that module exists."""
    if importlib.util.find_spec("graphkern.cli.commands") is None:
        return
    from . import bench, commands, debug, metal

    commands.register(main)
    debug.register(main)
    bench.register(main)
    metal.register(main)


_register_optional_commands()

if __name__ == "__main__":
    main()
