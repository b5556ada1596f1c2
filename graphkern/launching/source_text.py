"""Kernel source text as MLX is handed it: comments, indentation and the spaces between tokens out,
one backend's branch only.

MLX hashes a custom kernel's whole generated source on every launch, and builds that source anew
on every eager call of its kernel object, so text that never reaches a compiler costs host time
on each launch. ``for_backend`` keeps what the compiler needs and nothing else, line for line (a
removed line stays as an empty one, so the compiler's line numbers still point at the source).
Within a line a space stays only between two word characters (``const float``) and between two
operator characters, which could otherwise join into another token (``a - -b``, ``> >``);
preprocessor lines (``#pragma unroll``, ``#define``) are left as they are.

A header written for both backends (``two_backend_header``) keeps only its branch for the backend.
"""

from __future__ import annotations

import re

from .launch_cache import memoized

__all__ = ["for_backend", "two_backend_header"]

_CUDA_BRANCH = "#if defined(__CUDACC__)"
_OTHER_BRANCH = "#else  // graphkern: metal"
_END = "#endif  // graphkern"
# a string or character literal
_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
# a literal, a // comment, or a /* */ comment; literals are kept as they are
_TOKENS = re.compile(_LITERAL.pattern + r"|//[^\n]*|/\*.*?\*/", re.S)
# the spaces between two non-space characters, and those two
_GAP = re.compile(r"(?<=(\S)) +(?=(\S))")
# a literal's quotes count as word characters: ``u8 "a"`` must not become ``u8"a"``
_WORD = re.compile(r"[\w'\"]")
#: Characters that never join a neighbour into another token.
_DELIMITERS = frozenset("(),;{}[]")


def two_backend_header(cuda: str, metal: str) -> str:
    """One ``Kernel.header`` for both backends: NVRTC defines ``__CUDACC__``, Metal does not.

    >>> h = two_backend_header("int a;", "int b;")
    >>> for_backend(h, "cuda").split(), for_backend(h, "metal").split()
    (['int', 'a;'], ['int', 'b;'])
    """
    return f"\n{_CUDA_BRANCH}\n{cuda}\n{_OTHER_BRANCH}\n{metal}\n{_END}\n"


def _strip_comment(match: re.Match[str]) -> str:
    text = match.group(0)
    if text.startswith(("//", "/*")):
        return "\n" * text.count("\n")  # line breaks stay, so line numbers do
    return text


@memoized("source text", maxsize=256)
def for_backend(text: str, backend: str) -> str:
    """``text`` without comments, indentation, trailing blanks and the spaces no token needs, and,
    for a ``two_backend_header``, without the other backend's branch; line numbers are kept.

    >>> for_backend("  int a = b - -c;  // the count\\n  /* two\\n lines */ f(a, b);", "cuda")
    'int a=b- -c;\\n\\nf(a,b);'
    """
    return "\n".join(_compact(line) for line in _branch_lines(text, backend))


def _branch_lines(text: str, backend: str) -> list[str]:
    """The lines of ``text`` for ``backend``, without comments and indentation (the other branch
    of a ``two_backend_header`` and its directives left as empty lines)."""
    start, other, end = text.find(_CUDA_BRANCH), text.find(_OTHER_BRANCH), text.find(_END)
    if 0 <= start < other < end:
        cuda, metal = text[start + len(_CUDA_BRANCH):other], text[other + len(_OTHER_BRANCH):end]
        if backend == "cuda":
            metal = "\n" * metal.count("\n")
        else:
            cuda = "\n" * cuda.count("\n")
        text = text[:start] + cuda + metal + text[end + len(_END):]
    return [line.strip() for line in _TOKENS.sub(_strip_comment, text).split("\n")]


def _gap(match: re.Match[str]) -> str:
    """The spaces between two characters: none beside a delimiter or between a word character and
    an operator character, one between two of a kind."""
    left, right = match.group(1), match.group(2)
    if left in _DELIMITERS or right in _DELIMITERS:
        return ""
    return " " if bool(_WORD.match(left)) == bool(_WORD.match(right)) else ""


def _compact(line: str) -> str:
    """``line`` without the spaces no token needs (see the module's docstring); literals as they are."""
    if line.startswith("#"):
        return line
    literals = [m.span() for m in _LITERAL.finditer(line)]
    if not literals:
        return _GAP.sub(_gap, line)
    return _GAP.sub(lambda m: m.group(0) if any(a < m.start() < b for a, b in literals) else _gap(m), line)
