"""The ``graphkern`` command line (click). ``graphkern demo`` is the main job.

Other commands (trace, show, diff, view) are registered from ``graphkern.cli.commands``,
``debug`` from ``graphkern.cli.debug``, ``bench`` from ``graphkern.cli.bench`` and ``metal-check``
from ``graphkern.cli.metal``.
"""

from __future__ import annotations

import importlib.util

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphkern")
def main() -> None:
    """graphkern: custom GPU kernels as first-class nodes of MLX compiled graphs."""


@main.command()
@click.option("--out", "out_dir", default="graphkern-demo", show_default=True,
              type=click.Path(file_okay=False), help="Folder for graph.{json,dot,html} and broken.*.")
@click.option("--no-files", is_flag=True, help="Print only; write nothing.")
def demo(out_dir: str, no_files: bool) -> None:
    """Trace, compile and break a built-in kernel-backed model, printing what happens."""
    from ..demo import run_demo

    run_demo(None if no_files else out_dir, echo=click.echo)


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
