"""StructureWatch answers what ``structure_of`` compared call to call would, whatever changed."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from graphkern.models.structure import StructureWatch, structure_of


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4), nn.Linear(4, 2))


def test_new_values_are_not_a_new_structure() -> None:
    model = _model()
    watch = StructureWatch(model)
    for step in range(5):
        model.update({"layers": [{"weight": mx.full((4, 4), float(step))}, {}, {}]})
        model.layers[1].weight = mx.ones((4,)) * step
        assert not watch.changed()


def test_reshaped_retyped_or_swapped_is_a_new_structure() -> None:
    model = _model()
    watch = StructureWatch(model)
    model.layers[0].weight = mx.zeros((4, 5))
    assert watch.changed()
    model.layers[0].weight = mx.zeros((4, 5), dtype=mx.float16)
    assert watch.changed()
    original = model.layers[1]
    model.layers[1] = nn.RMSNorm(4)  # same class and shapes, another module
    assert watch.changed()
    model.layers[1] = original  # put back: a swap again
    assert watch.changed()
    model.layers.append(nn.Linear(2, 2))
    assert watch.changed()
    del model.layers[0]["bias"]
    assert watch.changed()
    assert not watch.changed()


def test_a_freed_array_never_passes_for_its_successor() -> None:
    """CPython reuses a freed object's address: replacing an array twice between two looks can
    put an array of another shape at the old id. The weak references' callbacks tell."""
    model = _model()
    watch = StructureWatch(model)
    for n in range(1, 60):
        model.layers[1].weight = mx.zeros((n,))
        model.layers[1].weight = mx.zeros((n + 1,))
        assert watch.changed()
        assert structure_of(model) == watch.structure


_OPS = st.lists(st.sampled_from(["values", "reshape", "retype", "swap", "restore", "same_list",
                                 "append", "drop_key", "nothing"]), min_size=1, max_size=12)


@settings(max_examples=60)
@given(_OPS)
def test_changed_agrees_with_structure_of(ops: list[str]) -> None:
    model = _model()
    originals = list(model.layers)
    kept: list[Any] = []  # every module made stays alive, so structure_of's ids stay unique
    watch = StructureWatch(model)
    last = structure_of(model)
    for op in ops:
        first = model.layers[0]
        if op == "values" and "weight" in first:
            first.weight = first.weight + 1
        elif op == "reshape" and "weight" in first:
            first.weight = mx.zeros((first.weight.shape[0] + 1, 4))
        elif op == "retype" and "weight" in first:
            first.weight = first.weight.astype(mx.float16)
        elif op == "swap":
            kept.append(model.layers[1])
            model.layers[1] = nn.RMSNorm(4)
        elif op == "restore":
            model.layers[1] = originals[1]
        elif op == "same_list":
            model.layers = list(model.layers)
        elif op == "append":
            model.layers.append(nn.Linear(2, 2))
        elif op == "drop_key" and "bias" in first:
            del first["bias"]
        now = structure_of(model)
        assert watch.changed() == (now != last), op
        last = now
