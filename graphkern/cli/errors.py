"""The exit statuses and the bad-input error every ``graphkern`` command shares."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "BadInput"]

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class BadInput(click.ClickException):
    """A clear message and exit status 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)
