"""``graphkern metal-check``: the library's Metal sources through clang's front end, on any machine."""

from __future__ import annotations

import click


@click.command("metal-check")
@click.argument("names", nargs=-1, metavar="[KERNEL]...")
@click.option("--dtype", "-d", "dtypes", multiple=True, type=click.Choice(["float32", "float16", "bfloat16"]),
              help="Only these dtypes (default: all three).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Parsing processes (default: cores).")
def metal_check_cmd(names: tuple[str, ...], dtypes: tuple[str, ...], jobs: int | None) -> None:
    """Check that library kernels' Metal sources compile, as MLX would generate them (no Mac needed).

    Every launch the library plans (dtypes, shapes, options, inputs small enough for constant
    memory) is generated as MLX's metal_kernel writes it and parsed by clang against the Metal
    standard library's declarations. Exit status 1 if any source fails.

    \b
    Examples:
      graphkern metal-check
      graphkern metal-check rope rope_qk -d bfloat16
    """
    import mlx.core as mx

    from graphkern.kernels import LIBRARY
    from graphkern.metal_check import check_library_metal

    unknown = [n for n in names if n not in LIBRARY]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not library kernels (known: {', '.join(LIBRARY)})",
                                 param_hint="KERNEL")
    report = check_library_metal(list(names) or None, [getattr(mx, d) for d in dtypes] or None, jobs)
    click.echo(str(report))
    raise SystemExit(0 if report.ok else 1)


def register(group: click.Group) -> None:
    """Add ``metal-check`` to the ``graphkern`` group."""
    group.add_command(metal_check_cmd)
