"""The exit statuses, the bad-input error and the failure report every ``graphkern`` command shares."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import click

from graphkern.nodes import KernelError

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INTERRUPTED", "BadInput", "Interrupted", "failing_as"]

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
#: What a shell reports for a process ended by SIGINT (128 + 2), as Ctrl-C ends a command.
EXIT_INTERRUPTED = 130


class BadInput(click.ClickException):
    """A clear message and exit status 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class Interrupted(click.ClickException):
    """Ctrl-C: one line and exit status 130 (click's own ``Aborted!`` exits 1, which ``debug``
    uses for a divergence found)."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self) -> None:
        super().__init__("interrupted")

    def show(self, file: Any = None) -> None:
        click.echo("interrupted (Ctrl-C)", err=True)


@contextlib.contextmanager
def failing_as(what: str, kernel_prefix: str = "") -> Iterator[None]:
    """Whatever ``what`` raises becomes one ``error:`` line and exit status 1: a graphkern error as
    its message (after ``kernel_prefix``), anything else with its type."""
    try:
        yield
    except KernelError as exc:
        click.echo(f"error: {kernel_prefix}{exc}", err=True)
        raise SystemExit(EXIT_FAILED) from None
    except Exception as exc:
        click.echo(f"error: {what} raised {type(exc).__name__}: {exc}", err=True)
        raise SystemExit(EXIT_FAILED) from None
