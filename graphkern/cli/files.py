"""The one place where ``graphkern`` commands check and write their output files.

A command that writes files is decorated with :func:`writes_files`, naming the parameters that are
its inputs; that adds ``--force``. :func:`check_outputs` (before any work) and :func:`write_files`
(each file through a temporary file and a rename) then refuse, with exit status 2:

- an output that is one of the command's inputs, or inside an input folder (a ``--model``
  checkpoint), even with ``--force``;
- an existing file that is read-only, or not a regular file, even with ``--force``;
- an existing file without ``--force``;
- an output folder that is missing or read-only, and two options naming the same file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import click

from graphkern.cli.errors import BadInput

__all__ = ["FORCE_HELP", "IMAGE_OPTIONS", "OutputRules", "check_outputs", "input_paths", "make_folder",
           "staged_output", "write_files", "writes_files"]

FORCE_HELP = ("Replace output files that exist (never an input of the command, a file inside "
              "the --model folder, or a read-only file).")

_META_KEY = "graphkern.output_rules"
IMAGE_OPTIONS = ("--svg", "--png", "--pdf")


@dataclass(frozen=True)
class Input:
    """One input of a command: as given (``label``) and its real path, a file or a folder."""

    label: str
    real: str
    folder: bool

    def holds(self, real: str) -> bool:
        """Whether writing ``real`` (a real path) would replace this input or a file inside it."""
        if self.folder:
            return real == self.real or real.startswith(self.real.rstrip(os.sep) + os.sep)
        return real == self.real or _same_file(real, self.real)


@dataclass(frozen=True)
class OutputRules:
    """What a command may replace: an existing output only with ``force``; never ``inputs``."""

    force: bool = False
    inputs: tuple[Input, ...] = ()

    def refusal(self, path: str) -> str | None:
        """Why ``path`` may not be written, or None."""
        real = os.path.realpath(path)
        for item in self.inputs:
            if item.holds(real):
                where = f"inside {item.label}" if item.folder else item.label
                return (f"{path} is an input of this command ({where}); write the output elsewhere "
                        "(--force never replaces an input)")
        if not os.path.lexists(path):
            return None
        if not _regular_file(path):
            return f"{path} exists and is not a regular file; give a file path"
        if _read_only(path):
            return f"{path} is read-only; make it writable to replace it"
        if not self.force:
            return f"{path} exists; pass --force to replace it"
        return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # a dangling link: the rename replaces the link
        return os.path.islink(path)


def _read_only(path: str) -> bool:
    """No write permission for this user, or no write bit at all (root may write anything, but a
    file or folder whose mode has no write bit was made read-only on purpose)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not os.access(path, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


# ----------------------------------------------------------------------------- inputs


def input_paths(value: str | Iterable[str] | None) -> list[Input]:
    """The files and folders a parameter's value names: a path that exists, or the source file of
    ``MODULE:CALLABLE`` (``file.py:fn``, or a module found from the working folder or sys.path)."""
    if value is None:
        return []
    if not isinstance(value, str):
        return [found for item in value for found in input_paths(item)]
    path = value if os.path.lexists(value) else os.path.expanduser(value)  # --model expands ~
    if not os.path.lexists(path) and ":" in value:
        path = _module_file(value.rpartition(":")[0]) or path
    if not os.path.lexists(path):
        return []
    real = os.path.realpath(path)
    return [Input(value, real, os.path.isdir(real))]


def _module_file(module: str) -> str | None:
    """The source file of ``module`` (``file.py``, ``pkg/mod.py``, ``pkg.mod``) without importing it."""
    if os.path.isfile(module):
        return module
    parts = module.split(".")
    for root in [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]:
        for candidate in (os.path.join(root, *parts) + ".py", os.path.join(root, *parts, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def writes_files(*inputs: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add ``--force`` to a click command that writes files; the parameters named in ``inputs``
    hold its input files and folders, which no output may replace."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, force: bool, **kwargs: Any) -> Any:
            found = tuple(i for name in inputs for i in input_paths(kwargs.get(name)))
            click.get_current_context().meta[_META_KEY] = OutputRules(force, found)
            return fn(*args, **kwargs)

        return click.option("--force", is_flag=True, help=FORCE_HELP)(run)

    return decorate


def current_rules() -> OutputRules:
    """The running command's rules (no ``--force``, no inputs outside a command)."""
    ctx = click.get_current_context(silent=True)
    rules = ctx.meta.get(_META_KEY) if ctx is not None else None
    return rules if isinstance(rules, OutputRules) else OutputRules()


# ----------------------------------------------------------------------------- checking and writing


@contextlib.contextmanager
def own_outputs(mark: str) -> Iterator[bool]:
    """Within the block, the running command may replace existing outputs (not inputs, not
    read-only files) when ``mark`` exists: a file it wrote itself in an earlier run. Yields
    whether it does."""
    ctx = click.get_current_context()
    rules = current_rules()
    own = os.path.isfile(mark) and not rules.force
    if own:
        ctx.meta[_META_KEY] = replace(rules, force=True)
    try:
        yield own
    finally:
        ctx.meta[_META_KEY] = rules


def check_outputs(paths: Mapping[str, str | None] | Iterable[tuple[str, str | None]]) -> None:
    """Refuse, before any work, an output (``{option: path}``, or (option, path) pairs) that
    cannot or may not be written."""
    items = list(paths.items() if isinstance(paths, Mapping) else paths)
    rules = current_rules()
    seen: dict[str, str] = {}
    for option, path in items:
        if not path:
            continue
        check_output(option, path, rules)
        real = os.path.realpath(path)
        if real in seen:
            raise BadInput(f"{seen[real]} and {option} both write {path}; give each its own file")
        seen[real] = option


def make_folder(option: str, path: str) -> None:
    """The output folder ``path`` of ``option``, made when missing."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise BadInput(f"{option} {path} is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{option} {path}: cannot make the folder: {e.strerror or e}") from None


def check_output(option: str, path: str, rules: OutputRules) -> None:
    """One output: its folder exists and is writable, it is not a folder, ``rules`` allow it, and
    an image's suffix matches its option."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BadInput(f"{option} {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise BadInput(f"{option} {path} is a folder")
    if _read_only(folder) or not os.access(folder, os.X_OK):
        raise BadInput(f"{option} {path}: folder {folder} is read-only")
    refusal = rules.refusal(path)
    if refusal:
        raise BadInput(refusal)
    if option in IMAGE_OPTIONS:  # --svg out.gif would write SVG into a .gif
        _check_image_suffix(option, path)


def _check_image_suffix(option: str, path: str) -> None:
    from graphkern.nodes import KernelError
    from graphkern.viz.dot import format_for

    try:
        format_for(path, option[2:])
    except KernelError as e:
        raise BadInput(f"{option} {path}: {e.description}") from None


def write_files(files: Mapping[str, bytes]) -> None:
    """Write each file through a temporary file and a rename, checking it again first (a file may
    have appeared since :func:`check_outputs`); an OS error is a clear error, exit status 2."""
    from graphkern.viz.common import atomic_write

    rules = current_rules()
    for path, data in files.items():
        refusal = rules.refusal(path)
        if refusal:
            raise BadInput(refusal)
        try:
            atomic_write(path, data)
        except OSError as e:
            raise BadInput(f"cannot write {path}: {e.strerror or e}") from None


@contextlib.contextmanager
def staged_output(path: str | None) -> Iterator[str | None]:
    """A temporary path beside ``path`` (same suffix) for a writer that makes the file itself; when
    the block ends cleanly it is moved onto ``path`` under the rules of :func:`write_files`, and
    removed otherwise. ``None`` gives ``None``."""
    if path is None:
        yield None
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, staging = tempfile.mkstemp(prefix=".gk-", suffix=os.path.splitext(path)[1], dir=folder)
    except OSError as e:
        raise BadInput(f"cannot write {path}: {e.strerror or e}") from None
    os.close(fd)
    try:
        yield staging
        _move_into_place(staging, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staging)


def _move_into_place(staging: str, path: str) -> None:
    refusal = current_rules().refusal(path)
    if refusal:
        raise BadInput(refusal)
    mask = os.umask(0)
    os.umask(mask)
    try:
        os.chmod(staging, 0o666 & ~mask)  # what open(path, "w") gives, not mkstemp's 0o600
        os.replace(staging, path)
    except OSError as e:
        raise BadInput(f"cannot write {path}: {e.strerror or e}") from None
