"""Kernel source text as MLX is handed it: comments and indentation out, one backend's branch only.

MLX hashes a custom kernel's whole generated source on every launch, and builds that source anew
on every eager call of its kernel object, so text that never reaches a compiler costs host time
on each launch. ``for_backend`` keeps what the compiler needs and nothing else, line for line (a
removed line stays as an empty one, so the compiler's line numbers still point at the source).

A header written for both backends (``two_backend_header``) keeps only its branch for the backend.
"""

from __future__ import annotations

import re

from .launch_cache import memoized

__all__ = ["for_backend", "two_backend_header"]

_CUDA_BRANCH = "#if defined(__CUDACC__)"
_OTHER_BRANCH = "#else  // graphkern: metal"
_END = "#endif  // graphkern"
# a string or character literal, a // comment, or a /* */ comment; literals are kept as they are
_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


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
    """``text`` without comments, indentation and trailing blanks, and, for a
    ``two_backend_header``, without the other backend's branch; line numbers are kept.

    >>> for_backend("  int a;  // the count\\n  /* two\\n lines */ int b;", "cuda")
    'int a;\\n\\nint b;'
    """
    start, other, end = text.find(_CUDA_BRANCH), text.find(_OTHER_BRANCH), text.find(_END)
    if 0 <= start < other < end:  # the directives go, their lines stay; the other branch is blanked
        cuda, metal = text[start + len(_CUDA_BRANCH):other], text[other + len(_OTHER_BRANCH):end]
        if backend == "cuda":
            metal = "\n" * metal.count("\n")
        else:
            cuda = "\n" * cuda.count("\n")
        text = text[:start] + cuda + metal + text[end + len(_END):]
    text = _TOKENS.sub(_strip_comment, text)
    return "\n".join(line.strip() for line in text.split("\n"))
