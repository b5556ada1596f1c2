"""The hand-built graphs of ``viz_graphs`` keep the graph's contract (``graphkern.tracing.schema``), so the
drawing tests and benchmarks that use them test what a real trace would give the viewers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import viz_graphs as vg

from graphkern.nodes import NodeKind, Status
from graphkern.tracing.schema import lint

BUILDERS: dict[str, Callable[[], Any]] = {
    "small": vg.small,
    "small failed": lambda: vg.small(failed=True),
    "transformer": vg.transformer,
    "transformer failed": lambda: vg.transformer(3, failed_layer=1),
    "big": lambda: vg.big(2_000),
    "big ok": lambda: vg.big(2_000, failed=False),
    "random_dag": vg.random_dag,
    "random_dag seed 7": lambda: vg.random_dag(300, seed=7),
}


@pytest.mark.parametrize("name", BUILDERS)
def test_hand_built_graphs_lint_clean(name: str) -> None:
    graph = BUILDERS[name]()
    assert lint(graph.nx) == []
    kinds = {data["kind"] for _, data in graph.nx.nodes(data=True)}
    assert {NodeKind.INPUT.value, NodeKind.OUTPUT.value} <= kinds


def test_their_status_codes_are_graphkerns() -> None:
    assert (vg.OK, vg.INVALID_LAUNCH, vg.COMPILE_ERROR, vg.UPSTREAM_FAILED) == (
        Status.OK, Status.INVALID_LAUNCH, Status.COMPILE_ERROR, Status.UPSTREAM_FAILED)
    graph = vg.small(failed=True)
    assert graph.status == Status.COMPILE_ERROR and lint(graph.nx) == []
