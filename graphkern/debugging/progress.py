"""A progress line on stderr for long work (``inspect``, ``compare``, ``check_model``): which
phase runs (tracing, parameters, values in which dtype) and how many of its steps are done.

``enabled``: True always, False never, None only when stderr is a terminal. On a terminal it is a
rich bar that goes away when the work ends; elsewhere (a log, a pipe) each phase prints one line.

>>> with progress_line(False, "compare") as progress:
...     progress.phase("values (bfloat16)", total=3)
...     progress.advance()
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["Progress", "progress_line"]


class Progress:
    """What the work reports: ``phase(text, total)`` starts a phase, ``advance(n)`` counts steps."""

    def phase(self, text: str, total: int | None = None) -> None:
        """A new phase of ``total`` steps (None: not counted)."""

    def advance(self, steps: int = 1) -> None:
        """``steps`` more steps of the current phase are done."""


class _Bar(Progress):
    def __init__(self, bar: Any, what: str):
        self.bar, self.what = bar, what
        self.task = bar.add_task(what, total=None)

    def phase(self, text: str, total: int | None = None) -> None:
        self.bar.reset(self.task, total=total, description=f"{self.what}: {text}")

    def advance(self, steps: int = 1) -> None:
        self.bar.advance(self.task, steps)


class _Lines(Progress):
    def __init__(self, what: str):
        self.what = what

    def phase(self, text: str, total: int | None = None) -> None:
        count = f" ({total} steps)" if total else ""
        print(f"{self.what}: {text}{count}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_line(enabled: bool | None, what: str) -> Iterator[Progress]:
    """Report the phases of ``what`` on stderr (see the module)."""
    if enabled is False:
        yield Progress()
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield _Lines(what) if enabled else Progress()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as RichProgress

    with RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
        yield _Bar(bar, what)
