"""What MLX is handed of a kernel's source: its backend's branch, no comments, no spaces a token
does not need, the same lines and the same tokens."""

from __future__ import annotations

import re

import pytest

from graphkern.kernels.registry import LIBRARY
from graphkern.launching.source_text import _branch_lines, _compact, for_backend, two_backend_header

KERNELS = {entry.kernel.name: entry.kernel for entry in LIBRARY.values()}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_backend_gets_its_own_branch_of_a_library_header_line_for_line(name: str) -> None:
    header = KERNELS[name].header
    cuda, metal = for_backend(header, "cuda"), for_backend(header, "metal")
    assert cuda.count("\n") == metal.count("\n") == header.count("\n")
    assert "__device__" in cuda and "__device__" not in metal
    assert "threadgroup" in metal and "threadgroup float" not in cuda
    assert "//" not in cuda and "/*" not in cuda and "#else" not in cuda
    assert len(cuda) < len(header) * 0.6  # about half of the text never reached NVRTC before


def test_comments_go_and_literals_stay() -> None:
    text = 'printf("a // b /* c */"); // gone\nx = \'/\'; /* gone\ntoo */ y = 1;'
    assert for_backend(text, "cuda") == 'printf("a // b /* c */");\nx=\'/\';\ny=1;'


def test_a_header_without_branches_is_only_compacted() -> None:
    assert for_backend("  int a;\n\n  int b = a;  ", "metal") == "int a;\n\nint b=a;"
    h = two_backend_header("int c;", "int m;")
    assert for_backend(h, "cuda").split() == ["int", "c;"]


# C++ tokens, longest first as a compiler reads them: literals, numbers, names, operators
_CPP_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|\.?\d(?:[eEpP][+-]|[\w.])*|\w+|'
                        r"<<=|>>=|->\*|\.\.\.|::|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^!=<>]=|\S")


def test_spaces_go_where_no_token_needs_them() -> None:
    assert _compact("out[at + d1] = static_cast<T>(o1);") == "out[at+d1]=static_cast<T>(o1);"
    assert _compact("template <typename T, int V>") == "template<typename T,int V>"
    # operator characters side by side could join: a - -b is not a -- b, > > not >>
    assert _compact("x = a - -b; Vec<Vec<T, V> > v; y = a & &b;") == "x=a- -b;Vec<Vec<T,V> >v;y=a& &b;"
    assert _compact('printf("a  b", u8 "c");') == 'printf("a  b",u8 "c");'
    assert _compact("#pragma  unroll 4") == "#pragma  unroll 4"


@pytest.mark.parametrize("backend", ["cuda", "metal"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_library_kernel_keeps_every_token(name: str, backend: str) -> None:
    kernel = KERNELS[name]
    for text in (kernel.header, kernel.source_for(backend) or ""):
        spaced, compact = _branch_lines(text, backend), for_backend(text, backend).split("\n")
        assert len(compact) == len(spaced)
        for before, after in zip(spaced, compact):
            assert _CPP_TOKEN.findall(after) == _CPP_TOKEN.findall(before), (before, after)
    shorter = len(for_backend(kernel.header, backend)) / len("\n".join(_branch_lines(kernel.header, backend)))
    assert shorter < 0.95
