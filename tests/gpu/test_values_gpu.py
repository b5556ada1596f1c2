"""gk.compare and gk.inspect on the GPU: a patched tiny model's CUDA (or Metal) kernels against the
same model with GRAPHKERN_BACKEND=reference, node by node.

What it checks, on a patched tiny mlx-lm llama and qwen3 in float32, float16 and bfloat16:

- every node of both runs gets values (``values.unreached == 0``): each MLX primitive the GPU trace
  holds (fast RMSNorm, RoPE, attention...) can be run again by graphkern. A failure here lists the
  nodes and why (``values_note``), which names the primitive graphkern could not run again;
- the GPU kernels' side is really on the GPU backend, the other on ``reference``;
- every matched node agrees within the tolerance ``check_model`` uses for logits of that dtype
  (``MODEL_TOLERANCES``: the kernels round once in float32, stock MLX between ops, so differences
  compound through the layers), and there is no divergence;
- each kernel, run on the exact inputs it received inside the model, matches its own reference
  within the kernel tolerances of ``gk.check`` (``kernel_checks.TOLERANCES``);
- no NaN or Inf anywhere.

Runs where ``mx.cuda.is_available()`` or Metal (the ``gpu`` marker skips elsewhere); with
GRAPHKERN_GPU_DRYRUN=1 on a CPU both sides run the references and the test checks its own logic.
Needs mlx-lm on the device. Prints each comparison's summary (``pytest -s`` to see them).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import graphkern as gk  # noqa: E402
from graphkern.debugging.kernel_checks import TOLERANCES  # noqa: E402
from graphkern.launching.backends import active_backend  # noqa: E402
from graphkern.models import MODEL_TOLERANCES  # noqa: E402
from graphkern.models.tiny import tiny_model  # noqa: E402
from graphkern.nodes import dtype_name  # noqa: E402

pytestmark = pytest.mark.gpu

TOKENS = mx.array([[3, 17, 42, 5, 99, 1, 7, 64, 12, 8, 2, 77], [8, 8, 120, 33, 2, 0, 71, 9, 1, 1, 4, 5]])
GPU = active_backend()  # cuda or metal on the device; reference in a CPU dry run


def _unreached(graph: gk.Graph) -> list[str]:
    return [f"{n} ({graph.node(n)['op']}): {graph.node(n)['values_note']}" for n in graph.nodes()
            if "values_note" in graph.node(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=dtype_name)
def test_gpu_kernels_against_their_references_node_by_node(arch: str, dtype: mx.Dtype) -> None:
    model = tiny_model(arch, dtype)
    gk.patch(model)
    atol, rtol = MODEL_TOLERANCES[dtype]
    c = gk.compare(model, model, TOKENS, rtol=rtol, atol=atol, backends=(None, "reference"),
                   check_kernels=True)
    print(f"\n{arch} {dtype}: {c}")
    assert not _unreached(c.a) and not _unreached(c.b), _unreached(c.a)[:10] + _unreached(c.b)[:10]
    assert c.a.nx.graph["backend"] == GPU and c.b.nx.graph["backend"] == "reference"
    assert {c.a.node(k)["backend"] for k in c.a.kernels()} == {GPU}
    assert c.a.ok and c.b.ok, (c.a.failures(), c.b.failures())  # no NaN/Inf started anywhere
    # every node of the GPU run found its counterpart (the reference run may hold a few more: its
    # kernels' ops), and none of them parts ways
    assert not c.unmatched_a and len(c.rows) > 50, c.unmatched_a[:10]
    assert c.first_divergence is None, c.table(c.diverged[:20])
    kernel_atol, kernel_rtol = TOLERANCES[dtype]
    gpu_checks = [k for k in c.kernel_checks if k.side == "a"]
    assert len(gpu_checks) == len(c.a.kernels()) > 5
    for check in gpu_checks:
        node = c.a.node(check.node)["reference_check"]
        assert node["rtol"] == rtol and node["atol"] == atol
        # the kernel against its own reference, with gk.check's kernel tolerance
        assert check.max_abs <= kernel_atol + kernel_rtol * max(1.0, _absmax(c.a, check.node)), check


def _absmax(graph: gk.Graph, node: str) -> float:
    stats = graph.node(node)["stats"]
    return float(stats["absmax"] or 0.0)


def test_inspect_on_the_gpu_names_a_nan_kernel() -> None:
    import planted_bugs as pb  # tests/helpers, on the path from tests/conftest.py

    g = gk.inspect(pb.nan_llama(), pb.TOKENS)
    assert not _unreached(g), _unreached(g)[:10]
    root = g.failures()[0]
    assert g.node(root.node)["kernel"] == "nan_sqrt" and g.node(root.node)["backend"] == GPU
    assert g.node(root.node)["scope"] == pb.NAN_SCOPE
    with pytest.raises(gk.GraphError) as info:
        gk.wrap(pb.nan_llama(), check_finite=True)(pb.TOKENS)
    assert info.value.node == root.node and pb.NAN_SCOPE in str(info.value)
