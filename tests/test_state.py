"""Flattening call arguments: ``static_key`` is ``Flat``'s static key, computed without flattening."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from hypothesis import given
from hypothesis import strategies as st

from graphkern.tracing.state import Flat, static_key

Pair = namedtuple("Pair", ["a", "b"])
_ARRAYS = [mx.ones((2,)), mx.zeros((3, 1), dtype=mx.float16)]
_MODULE = nn.Linear(2, 2)

leaves = st.one_of(st.sampled_from(_ARRAYS), st.integers(-3, 3), st.floats(allow_nan=False, width=16),
                   st.text(max_size=2), st.none(), st.just(_MODULE), st.just(int))
trees = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.lists(inner, max_size=3).map(tuple),
    st.tuples(inner, inner).map(lambda t: Pair(*t)),
    st.dictionaries(st.text(max_size=2), inner, max_size=3),
), max_leaves=8)


@given(st.lists(trees, max_size=3),
       st.dictionaries(st.sampled_from(["cache", "mask", "y"]), trees, max_size=2))
def test_static_key_is_flats_static_key(args: list[Any], kwargs: dict[str, Any]) -> None:
    assert static_key(tuple(args), kwargs) == Flat.of(tuple(args), kwargs, ["x", "z"]).key()[0]


def test_static_key_tells_structure_and_values_apart_but_not_shapes() -> None:
    x, y = mx.ones((2,)), mx.zeros((5, 5))
    assert static_key((x,), {"n": 3}) == static_key((y,), {"n": 3})  # shapes are not static
    assert static_key((x,), {"n": 3}) != static_key((x,), {"n": 4})
    assert static_key(([x],), {}) != static_key(((x,),), {})
    assert static_key((x, x), {}) != static_key((x,), {"y": x})
