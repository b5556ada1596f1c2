"""Parse a generated Metal source with clang's front end and report what Metal would refuse.

clang (the ``libclang`` wheel) reads the text in C++ for OpenCL 2021 mode against graphkern's
declarations of the Metal standard library (``include/metal_stdlib``). The text is MLX's, with
four changes that keep every line where it was and change nothing Metal checks:

- the kernel's ``template <...>`` line becomes a namespace holding the template values as aliases
  and constants, and its explicit instantiation line is blanked (an OpenCL kernel cannot be a
  template; the body is then checked as the instantiation it is);
- ``[[kernel]]`` becomes ``__kernel``, so ``threadgroup`` variables may be declared in its body;
- a member function qualified ``thread`` is qualified ``__generic`` (clang makes return values
  and temporaries there, Metal in ``thread`` memory);
- MLX's preamble is parsed once into a precompiled header, so the kernel's text is the file clang
  reports lines of.

On top of clang's errors the check applies what clang's OpenCL rules do not: an implicit conversion
to ``bfloat`` (from clang's -Wimplicit-float-conversion) and threadgroup memory past Apple GPUs'
32 KiB, summed over the kernel's ``threadgroup`` variables as instantiated.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from graphkern.metal_check.source import MetalSource, utils_preamble

__all__ = ["THREADGROUP_MEMORY_LIMIT", "Diagnostic", "parse_metal"]

#: Threadgroup memory of an Apple GPU (``maxThreadgroupMemoryLength``), over all of a kernel's arrays.
THREADGROUP_MEMORY_LIMIT = 32768

_KERNEL_FILE = "kernel.metal"
_TEMPLATE_CLAUSE = re.compile(r"template <([^<>]*)>\n$")
# a member function qualified ``thread`` (``complex_t() thread``): clang builds return values and
# temporaries in OpenCL's generic address space, where Metal builds them in ``thread`` memory
_THREAD_METHOD = re.compile(r"\)(\s*const)?\s*thread\b")
_BFLOAT_CONVERSION = re.compile(
    r"implicit conversion loses floating-point precision: '[^']*' to .*(bfloat|__bf16)")


@dataclass(frozen=True)
class Diagnostic:
    """One problem: ``where`` is ``body``, ``header``, ``generated`` or ``preamble``; ``line`` is the
    line in that text (the body's own line numbers for ``body``)."""

    where: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        return f"{self.where} line {self.line}:{self.column}: {self.message}"


@functools.cache
def _clang() -> Any:
    try:
        import clang.cindex as cindex
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError("the Metal check needs libclang: pip install 'graphkern[metal-check]'") from exc
    return cindex


@functools.cache
def _index() -> Any:
    index = _clang().Index.create()
    atexit.register(_index.cache_clear)  # dispose of it while libclang is still loaded
    return index


def _include_dir() -> str:
    return str(resources.files("graphkern.metal_check") / "include")


@functools.cache
def _builtin_declarations() -> str:
    """The Metal compiler's ``__metal_*`` builtins that MLX's preamble calls, declared generically."""
    names = sorted(set(re.findall(r"\b(__metal_\w+)\s*\(", utils_preamble())))
    return "".join(f"template <typename T, typename... A> T {n}(T, A...);\n" for n in names)


def _instance_scope(params: str, template_values: tuple[str, ...]) -> str:
    """``template <typename T, int N>`` with values [float, 4] -> ``namespace ... { using T = float; ...``."""
    decls = []
    for param, value in zip((p.strip() for p in params.split(",")), template_values):
        kind, name = param.split()
        decls.append(f"using {name} = {value};" if kind == "typename"
                     else f"constexpr {kind} {name} = {value};")
    return "namespace gk_instance { " + " ".join(decls)


def checked_text(source: MetalSource) -> str:
    """``source.text`` as the front end reads it (see the module docstring); same line count."""
    text = source.text
    kernel = text.index(f"[[kernel]] void {source.name}(")
    head, rest = text[:kernel], "__kernel void " + text[kernel + len("[[kernel]] void "):]
    match = _TEMPLATE_CLAUSE.search(head)
    scoped = bool(source.template_values) and match is not None
    if scoped and match is not None:  # the clause MLX wrote just before the kernel (after the header)
        head = head[:match.start()] + _instance_scope(match.group(1), source.template_values) + "\n"
    rest = re.sub(r'(?m)^template \[\[host_name\(".*$', "", rest)
    arrays = _THREADGROUP_DECL.findall(source.body)
    if arrays:  # on the kernel's closing line, so every other line keeps its number
        total = " + ".join(f"sizeof({a})" for a in arrays)
        closing = rest.rstrip("\n").rfind("\n}") + 1
        check = f'static_assert({total} <= {THREADGROUP_MEMORY_LIMIT}, "{_TOO_MUCH_THREADGROUP}"); '
        rest = rest[:closing] + check + rest[closing:]
    text = head + rest
    if scoped:
        text = text.rstrip("\n") + " }\n"
    return text


_ARGS = ("-x", "cl", "-cl-std=clc++2021", "-cl-no-stdinc", "-fsyntax-only", "-ferror-limit=0",
         "-Wimplicit-float-conversion", "-D__METAL__", "-D__METAL_VERSION__=320", "-D__HAVE_BFLOAT__",
         "-DMLX_METAL_JIT")
_LOCK = threading.Lock()
_TOO_MUCH_THREADGROUP = "graphkern: threadgroup memory over the limit"
#: (header, body) pairs whose function parameters were checked for address spaces
_POINTERS_CHECKED: set[tuple[str, str]] = set()
# a threadgroup array's name; sources as MLX is handed them have no space after a type's ``>``
_THREADGROUP_DECL = re.compile(r"^threadgroup\s+[\w:<>, ]+?(?:\s+|(?<=>))(\w+)\s*\[", re.M)


def _args() -> list[str]:
    return [*_ARGS, f"-I{_include_dir()}"]


@functools.cache
def _precompiled_preamble() -> str:
    """MLX's utils preamble (with the Metal builtins it calls) parsed once into a clang PCH file, so
    each kernel costs a parse of its own text only. Preamble errors are the check's own bug: raise."""
    cindex = _clang()
    text = _THREAD_METHOD.sub(r")\1 __generic", _builtin_declarations() + utils_preamble())
    unit = _index().parse("gk_metal_preamble.h", args=_args(), unsaved_files=[("gk_metal_preamble.h", text)],
                          options=cindex.TranslationUnit.PARSE_INCOMPLETE)
    errors = [str(d) for d in unit.diagnostics if d.severity >= cindex.Diagnostic.Error]
    if errors:
        raise RuntimeError("graphkern's Metal declarations do not parse MLX's preamble: "
                           + "; ".join(errors[:5]))
    folder = tempfile.mkdtemp(prefix="graphkern-metal-check-")
    path = os.path.join(folder, "preamble.pch")
    unit.save(path)
    atexit.register(shutil.rmtree, folder, True)
    return path


def parse_metal(source: MetalSource) -> list[Diagnostic]:
    """Every error clang finds in ``source`` as Metal would compile it, plus the checks described above."""
    cindex = _clang()
    text = _THREAD_METHOD.sub(r")\1 __generic", checked_text(source))
    with _LOCK:
        unit = _index().parse(_KERNEL_FILE, args=[*_args(), "-include-pch", _precompiled_preamble()],
                              unsaved_files=[(_KERNEL_FILE, text)])
        found = []
        for diag in unit.diagnostics:
            is_error = diag.severity >= cindex.Diagnostic.Error
            if not is_error and not _BFLOAT_CONVERSION.search(diag.spelling):
                continue
            message = diag.spelling
            if not is_error:
                message = "implicit conversion to bfloat (Metal converts only explicitly): " + message
            found.append(_located(source, diag.location, message))
        over_limit = any(_TOO_MUCH_THREADGROUP in d.spelling for d in unit.diagnostics)
        found = [d for d in found if _TOO_MUCH_THREADGROUP not in d.message]
        pointers_unchecked = (source.header, source.body) not in _POINTERS_CHECKED
        if over_limit or pointers_unchecked:  # AST walks cost more than the parse: only when needed
            own = [c for c in unit.cursor.get_children()
                   if c.location.file is not None and c.location.file.name.endswith(_KERNEL_FILE)]
            if pointers_unchecked:
                found.extend(_unqualified_pointers(own, source))
                if not found:
                    _POINTERS_CHECKED.add((source.header, source.body))
            if over_limit:
                found.extend(_threadgroup_memory(own, source))
    return found


def _walk(cursors: list[Any]) -> Iterator[Any]:
    for top in cursors:
        yield from top.walk_preorder()


def _unqualified_pointers(own: list[Any], source: MetalSource) -> list[Diagnostic]:
    """Pointer parameters without an address space (OpenCL's generic one, which Metal lacks)."""
    cindex = _clang()
    found = []
    for cursor in _walk(own):
        if (cursor.kind == cindex.CursorKind.PARM_DECL
                and "__generic" in cursor.type.spelling and "*" in cursor.type.spelling):
            found.append(_located(source, cursor.location,
                                  f"parameter '{cursor.spelling}' is a pointer without an address space "
                                  "(Metal needs device, constant, threadgroup or thread)"))
    return found


def _located(source: MetalSource, location: Any, message: str) -> Diagnostic:
    file = location.file.name if location.file else ""
    line = location.line
    if file.endswith(_KERNEL_FILE):
        where, line = source.origin(line)
    else:
        where = "preamble" if file.endswith("gk_metal_check.metal") else file.rsplit("/", 1)[-1]
    return Diagnostic(where, line, location.column, message)


def _threadgroup_memory(own: list[Any], source: MetalSource) -> list[Diagnostic]:
    """The kernel's threadgroup variables, added up, against THREADGROUP_MEMORY_LIMIT."""
    cindex = _clang()
    kernel = next((c for c in _walk(own)
                   if c.kind == cindex.CursorKind.FUNCTION_DECL and c.spelling == source.name
                   and c.is_definition()), None)
    if kernel is None:
        return []
    total, declared, first = 0, [], None
    for cursor in kernel.walk_preorder():
        if cursor.kind == cindex.CursorKind.VAR_DECL and "__local" in cursor.type.spelling:
            size = cursor.type.get_size()
            if size > 0:
                total += size
                declared.append(f"{cursor.spelling} {size} B")
                first = first or cursor.location
    if total <= THREADGROUP_MEMORY_LIMIT or first is None:
        return []
    where, line = source.origin(first.line)
    return [Diagnostic(where, line, first.column,
                       f"threadgroup memory {total} B is over Apple GPUs' {THREADGROUP_MEMORY_LIMIT} B "
                       f"({', '.join(declared)})")]
