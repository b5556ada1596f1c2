"""The quantized norm-fed projection kernels (graphkern.kernels.ops.quantized_projections) and the
patched quantized blocks decoding through them: on the CPU the kernels run their references, which
are stock MLX's ops, so a patched quantized model must equal the stock one exactly, logits and
greedy tokens. The models are patched with ``kernels="all"``: ``quantized_matvec`` is opt-in."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import batch_generate, spy_on_kernels  # noqa: E402

import graphkern as gk  # noqa: E402
import graphkern.kernels as gkk  # noqa: E402
import graphkern.models.routes as routes  # noqa: E402
from graphkern.debugging.tolerance import TOLERANCES, worst_errors  # noqa: E402
from graphkern.kernels.ops.quantized_matvec import matvec_case  # noqa: E402
from graphkern.kernels.ops.quantized_projections import quantized_case, random_quantized  # noqa: E402
from graphkern.kernels.ops.quantized_rope_projections import rotated_case  # noqa: E402
from graphkern.models import MODEL_TOLERANCES, decode_launches  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, random_model  # noqa: E402

PROMPT = mx.array([3, 17, 42, 5, 99, 1, 7, 64])
KERNELS = ("norm_projections", "norm_swiglu", "norm_geglu", "quantized_norm_projections",
           "quantized_norm_rope_projections", "quantized_norm_swiglu", "quantized_norm_geglu",
           "quantized_matvec")
#: What a patched quantized block runs an 8-token prompt and then single tokens with: a Llama-style
#: attention's whole prologue in one launch for a token (up to ``ROTATED_MAX_ROWS`` rows; Phi-3's
#: one fused ``qkv_proj`` as its query, key and value row ranges), its projections apart from
#: ``rope_qk`` for the prompt (Qwen 2's biases added in the launch for a token, after the products
#: for the prompt); Qwen 3's and Gemma 3's (whose heads are normalized before the RoPE) always
#: apart. Gemma's feed-forwards (GeGLU; Gemma 2's and 3's between post-norms) run on the GeGLU kernel.
#: Every block's output and down projections take a token's row through ``quantized_matvec``.
DECODING = {"llama": {"quantized_norm_projections", "quantized_norm_rope_projections",
                      "quantized_norm_swiglu", "quantized_matvec"},
            "qwen3": {"quantized_norm_projections", "quantized_norm_swiglu", "quantized_matvec"},
            "phi3": {"quantized_norm_projections", "quantized_norm_rope_projections",
                     "quantized_norm_swiglu", "quantized_matvec"},
            "gemma": {"quantized_norm_projections", "quantized_norm_rope_projections",
                      "quantized_norm_geglu", "quantized_matvec"},
            "gemma2": {"quantized_norm_projections", "quantized_norm_rope_projections",
                       "quantized_norm_geglu", "quantized_matvec"},
            "gemma3": {"quantized_norm_projections", "quantized_norm_geglu", "quantized_matvec"},
            "qwen2": {"quantized_norm_projections", "quantized_norm_rope_projections",
                      "quantized_norm_swiglu", "quantized_matvec"}}
#: The gated entries, and the arguments each takes besides its gate and up.
GATED = {"quantized_norm_swiglu": {}, "quantized_norm_geglu": {"approx": False},
         "quantized_norm_geglu_approx": {"approx": True}}


def _case(name: str, shape: tuple[int, ...], dtype: mx.Dtype, key: mx.array, group_size: int,
          bits: int) -> gkk.Case:
    """Arguments for the quantized entry ``name``: gated ones for a gated entry."""
    if name == "quantized_matvec":
        return matvec_case(shape, dtype, key, group_size=group_size, bits=bits)
    return quantized_case(shape, dtype, key, gated=name in GATED, group_size=group_size, bits=bits,
                          **GATED.get(name, {}))


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_kernels_give_stock_mlx_products(bits: int, group_size: int, dtype: mx.Dtype) -> None:
    for entry in (gkk.LIBRARY[name] for name in ("quantized_norm_projections", *GATED)):
        case = _case(entry.name, (2, 1, 256), dtype, mx.random.key(1), group_size, bits)
        ours, stock = entry(case), entry.stock_outputs(case)
        assert [o.shape for o in ours] == [s.shape for s in stock]
        assert all(mx.array_equal(o, s).item() for o, s in zip(ours, stock)), entry.name


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rows_of_one_group_give_stock_mlx_products(group_size: int, bits: int, dtype: mx.Dtype) -> None:
    """Rows exactly one quantization group long, one and several of them: an edge where a product
    loop over groups runs once. The rotating kernel's RoPE rounds apart from stock's: it agrees
    within the entry's tolerance, the others exactly."""
    for entry in (gkk.LIBRARY[name] for name in (*KERNELS, "quantized_norm_geglu_approx")
                  if name.startswith("quantized")):
        for rows in (1, 8):
            if entry.name == "quantized_norm_rope_projections":
                case = rotated_case((1, rows, group_size), dtype, mx.random.key(rows), group_size=group_size,
                                    bits=bits)
            else:
                case = _case(entry.name, (rows, group_size), dtype, mx.random.key(rows), group_size, bits)
            ours, stock = entry(case), entry.stock_outputs(case)
            if entry.name == "quantized_norm_rope_projections":
                atol, rtol = entry.tolerances.get(dtype, TOLERANCES[dtype])
                assert worst_errors(ours, stock, rtol=rtol, atol=atol)[2], (entry.name, rows)
            else:
                assert all(mx.array_equal(o, s).item() for o, s in zip(ours, stock)), (entry.name, rows)


def test_without_residual_or_weight_the_products_come_alone() -> None:
    x = mx.random.normal((1, 128), key=mx.random.key(0))
    q = random_quantized(48, 128, mx.float32, mx.random.key(1), 64, 4)
    (y,) = gkk.quantized_norm_projections(x, None, [q], eps=1e-6, group_size=64, bits=4)
    expected = mx.quantized_matmul(mx.fast.rms_norm(x, None, 1e-6), *q, transpose=True, group_size=64, bits=4)
    assert y.shape == (1, 48) and mx.array_equal(y, expected).item()


def _bad(**change: Any) -> Any:
    x, w = mx.ones((2, 64)), mx.ones((64,))
    q = random_quantized(8, 64, mx.float32, mx.random.key(0), 64, 4)
    args: dict[str, Any] = {"x": x, "weight": w, "projections": [q], "group_size": 64, "bits": 4}
    args.update(change)
    return lambda: gkk.quantized_norm_projections(**args)


@pytest.mark.parametrize("call, says", [
    (_bad(bits=3), "bits is 3"),
    (_bad(group_size=16), "group_size is 16"),
    (_bad(x=mx.ones((2, 96)), weight=mx.ones((96,)), group_size=64), "not a multiple of group_size 64"),
    (_bad(projections=[]), "1 to 3"),
    (_bad(projections=[(mx.ones((8, 8)),)]), "triple"),
    (_bad(projections=[(mx.ones((8, 8)), mx.ones((8, 1)), mx.ones((8, 1)))]), "expected uint32 (N, 8)"),
    (_bad(projections=[(mx.zeros((8, 8), mx.uint32), mx.ones((8, 2)), mx.ones((8, 1)))]),
     "scales have shape"),
    (_bad(projections=[(mx.zeros((8, 8), mx.uint32), mx.ones((8, 1), mx.float16), mx.ones((8, 1)))]),
     "dtype mismatch"),
    (_bad(bits=8), "expected uint32 (N, 16)"),
    (_bad(x=mx.ones((9, 64))), "1 to 8 rows"),
])
def test_bad_arguments_are_refused_by_name(call: Any, says: str) -> None:
    with pytest.raises(gk.KernelError) as raised:
        call()
    assert raised.value.operation == "quantized_norm_projections" and says in str(raised.value)
    x = mx.ones((1, 64))
    q = random_quantized(8, 64, mx.float32, mx.random.key(0), 64, 4)
    assert gkk.quantized_norm_projections(x, None, [q])[0].shape == (1, 8)  # MLX still usable


# ----------------------------------------------------------------------------- patched models


def _quantized_model(arch: str, bits: int, group_size: int, mode: str = "affine",
                     dtype: mx.Dtype = mx.float32) -> nn.Module:
    """A tiny random ``arch`` of hidden size 128 (groups of 128 fit), quantized as mlx-lm's converter
    does (embeddings and output layer included), in evaluation mode."""
    config = {**TINY_CONFIGS[arch], "hidden_size": 128, "intermediate_size": 256}
    if "head_dim" in config:
        config["head_dim"] = 32  # o_proj takes 4 heads of 32: 128 inputs
    model = random_model(config, dtype)
    nn.quantize(model, group_size=group_size, bits=bits, mode=mode)
    model.eval()
    return model


def _logits(model: nn.Module, steps: int = 4) -> list[mx.array]:
    cache = make_prompt_cache(model)
    logits = [model(PROMPT[None], cache=cache)]
    for _ in range(steps):
        token = mx.argmax(logits[-1][:, -1:], axis=-1)
        logits.append(model(token, cache=cache))
    return logits


def _greedy(model: nn.Module, tokens: int = 16) -> list[int]:
    steps = generate_step(PROMPT, model, max_tokens=tokens, prompt_cache=make_prompt_cache(model))
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("arch, bits, group_size", [
    ("llama", 4, 64), ("llama", 4, 32), ("llama", 8, 128), ("qwen3", 4, 64), ("qwen3", 8, 32),
    ("qwen3", 4, 128), ("llama", 8, 64), ("phi3", 4, 64), ("phi3", 8, 128),
    ("gemma", 4, 64), ("gemma2", 4, 64), ("gemma2", 8, 32), ("gemma3", 4, 64), ("qwen2", 4, 64),
    ("qwen2", 8, 32),
])
def test_a_patched_quantized_model_decodes_through_the_quantized_kernels_as_stock(
        arch: str, bits: int, group_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    stock, patched = _quantized_model(arch, bits, group_size), _quantized_model(arch, bits, group_size)
    report = gk.patch(patched, kernels="all")
    assert not any(p.note for p in report)
    calls = spy_on_kernels(monkeypatch, KERNELS)
    # equal, Gemma's too: its feed-forward's GELU is the GeGLU kernel's reference, stock's formula
    for ours, theirs in zip(_logits(patched), _logits(stock)):
        assert mx.array_equal(ours, theirs).item()
    assert set(calls) == DECODING[arch]
    assert _greedy(patched) == _greedy(stock)


@pytest.mark.parametrize("bits, group_size, mode, says", [
    (3, 64, "affine", "3-bit affine"), (4, 32, "mxfp4", "4-bit mxfp4")])
def test_quantization_the_kernels_do_not_read_keeps_stock_products_with_a_note(
        bits: int, group_size: int, mode: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # mxfp4 dequantizes its embeddings to bfloat16: a model of that dtype, held to its tolerance
    dtype = mx.float32 if mode == "affine" else mx.bfloat16
    stock, patched = (_quantized_model("llama", bits, group_size, mode, dtype) for _ in range(2))
    notes = {p.path: p.note for p in gk.patch(patched, kernels="all") if p.note}
    assert sorted(notes) == ["model.layers.0", "model.layers.1"]
    assert says in notes["model.layers.0"] and "q_proj, k_proj, v_proj" in notes["model.layers.0"]
    assert "gate_proj, up_proj" in notes["model.layers.0"]
    calls = spy_on_kernels(monkeypatch, KERNELS)
    atol, rtol = (0.0, 0.0) if dtype == mx.float32 else MODEL_TOLERANCES[dtype]
    for ours, theirs in zip(_logits(patched, 2), _logits(stock, 2)):
        assert mx.allclose(ours, theirs, atol=atol, rtol=rtol).item()
    assert calls == []


def test_the_quantized_kernels_can_be_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    patched = _quantized_model("llama", 4, 64)
    gk.patch(patched, kernels=["add_rms_norm", "rope_qk", "swiglu", "quantized_norm_swiglu"])
    calls = spy_on_kernels(monkeypatch, KERNELS)
    _logits(patched, 1)
    assert set(calls) == {"quantized_norm_swiglu"}


#: RoPE layers of mlx-lm's Llama the fused prologue stands in for: the plain one, Llama 3's
#: frequencies, YaRN's (input scale), the traditional (interleaved) pairs.
ROPES = {
    "plain": {},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "traditional": {"rope_traditional": True},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_a_quantized_llama_decodes_its_attention_prologue_in_one_launch(
        rope: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits equal stock's, every block entered through ``quantized_norm_rope_projections``, and
    so do batched generation's tokens (mlx-lm's BatchGenerator: left-padded prompts, an offset per
    sequence; two sequences, two rows a step)."""
    prompts = [[3, 17, 42, 5, 8, 21], [7, 64, 2, 8, 11, 4, 9, 1]]
    config = {**TINY_CONFIGS["llama"], "hidden_size": 128, "intermediate_size": 256, **ROPES[rope]}
    stock, patched = random_model(config, mx.float32), random_model(config, mx.float32)
    patched.update(stock.parameters())
    for model in (stock, patched):
        nn.quantize(model, group_size=64, bits=4)
        model.eval()
    gk.patch(patched, kernels="all")
    calls = spy_on_kernels(monkeypatch, [*KERNELS, "rope_qk"])
    for ours, theirs in zip(_logits(patched), _logits(stock)):
        assert mx.array_equal(ours, theirs).item()
    assert set(calls) == {*DECODING["llama"], "rope_qk"}
    calls.clear()
    assert batch_generate(patched, prompts, 5) == batch_generate(stock, prompts, 5)
    # its prefill of 16 rows, past MAX_ROWS, takes rope_qk; each step of 2 rows the fused kernels
    assert set(calls) == {"rope_qk", "quantized_norm_rope_projections", "quantized_norm_swiglu",
                          "quantized_matvec"}


@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_quantized_phi3_decodes_its_fused_qkv_prologue_in_one_launch(
        bits: int, group_size: int, dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3's one ``qkv_proj`` goes into ``quantized_norm_rope_projections`` as its query, key and
    value row ranges: each token decoded on the warm cache gives stock's logits (equal in float32,
    within the model tolerance in bfloat16) from that launch, without ``rope_qk``; and a decode step
    on a GPU's routes launches it once a block, with no ``rope_qk`` and no split."""
    stock, patched = (_quantized_model("phi3", bits, group_size, dtype=dtype) for _ in range(2))
    gk.patch(patched, kernels="all")
    atol, rtol = (0.0, 0.0) if dtype == mx.float32 else MODEL_TOLERANCES[dtype]
    caches = [make_prompt_cache(m) for m in (patched, stock)]
    ours, theirs = patched(PROMPT[None], cache=caches[0]), stock(PROMPT[None], cache=caches[1])
    calls = spy_on_kernels(monkeypatch, [*KERNELS, "rope_qk"])
    for _ in range(4):
        assert mx.allclose(ours, theirs, atol=atol, rtol=rtol).item(), mx.abs(ours - theirs).max().item()
        token = mx.argmax(theirs[:, -1:], axis=-1)
        ours, theirs = patched(token, cache=caches[0]), stock(token, cache=caches[1])
    assert mx.allclose(ours, theirs, atol=atol, rtol=rtol).item()
    assert set(calls) == {"quantized_norm_rope_projections", "quantized_norm_swiglu", "quantized_matvec"}
    monkeypatch.setattr(routes, "on_gpu_backend", lambda: True)
    kinds = decode_launches(patched).kinds
    assert kinds["gk_quantized_norm_rope_projections"] == len(patched.model.layers)
    # each block's o_proj and down_proj, and the output layer
    assert kinds["gk_quantized_matvec"] == 2 * len(patched.model.layers) + 1
    assert not {"gk_rope_qk", "gk_quantized_norm_projections"} & set(kinds)


#: Phi-3.5 mini's attention: Phi-3's, its RoPE scaled by LongRoPE (mlx-lm's ``SuScaledRoPE``), a
#: factor a frequency for short contexts and one for long.
PHI35_ROPE = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
              "rope_scaling": {"type": "longrope", "long_factor": [1.0 + 0.1 * i for i in range(16)],
                               "short_factor": [1.0 + 0.05 * i for i in range(16)]}}


@pytest.mark.parametrize("bits", [None, 4])
def test_a_phi35_decodes_as_stock_through_the_fused_blocks(bits: int | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3.5 mini (Phi-3 with LongRoPE), plain and 4-bit, float32: the prompt and each token
    decoded on the warm cache give stock's logits exactly, and a decode step on a GPU's routes runs
    the fused block's kernels, the fused ``qkv_proj`` split and rotated there."""
    config = {**TINY_CONFIGS["phi3"], "hidden_size": 128, "intermediate_size": 256, **PHI35_ROPE}
    stock = random_model(config, mx.float32)
    patched = random_model(config, mx.float32)
    if bits:
        for model in (stock, patched):
            nn.quantize(model, group_size=64, bits=bits)
    patched.update(stock.parameters())
    for model in (stock, patched):
        model.eval()
    gk.patch(patched, kernels="all")
    assert type(patched.model.layers[0].self_attn.rope).__name__ == "KernelSuScaledRoPE"
    for ours, theirs in zip(_logits(patched), _logits(stock)):
        assert mx.array_equal(ours, theirs).item(), mx.abs(ours - theirs).max().item()
    monkeypatch.setattr(routes, "on_gpu_backend", lambda: True)
    kinds = decode_launches(patched).kinds
    fused = ("gk_quantized_norm_rope_projections", "gk_quantized_norm_swiglu") if bits else (
        "gk_norm_projections", "gk_norm_swiglu")
    assert all(kinds[name] == len(patched.model.layers) for name in fused), kinds
    assert kinds.get("gk_quantized_matvec", 0) == (2 * len(patched.model.layers) + 1 if bits else 0)


def test_rows_past_two_decode_through_the_projections_and_rope_qk_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 4 tokens (4 rows), off a GPU's row limits: the two kernels apart, each with its
    full warps a row, and the output and down products on ``quantized_matvec``."""
    stock, patched = (_quantized_model("llama", 4, 64) for _ in range(2))
    patched.update(stock.parameters())
    gk.patch(patched, kernels="all")
    calls = spy_on_kernels(monkeypatch, [*KERNELS, "rope_qk"])
    prompt = mx.broadcast_to(PROMPT[None], (4, PROMPT.size))
    caches = [make_prompt_cache(m) for m in (patched, stock)]
    for m, c in zip((patched, stock), caches):
        m(prompt, cache=c)
    calls.clear()
    token = mx.array([[5]] * 4)
    ours, theirs = patched(token, cache=caches[0]), stock(token, cache=caches[1])
    assert mx.array_equal(ours, theirs).item()
    assert set(calls) == {"quantized_norm_projections", "rope_qk", "quantized_norm_swiglu",
                          "quantized_matvec"}


def test_the_rotating_kernel_takes_an_offset_per_sequence() -> None:
    entry = gkk.LIBRARY["quantized_norm_rope_projections"]
    case = rotated_case((2, 1, 128), mx.float32, mx.random.key(3))
    case.kwargs["offset"] = mx.array([5, 40])
    ours, stock = entry(case), entry.stock_outputs(case)
    assert all(mx.allclose(o, s, atol=1e-5, rtol=1e-5).item() for o, s in zip(ours, stock))
    case.kwargs["offset"] = 5  # the same with the first offset for both: the second differs
    assert not mx.allclose(entry(case)[2][1], ours[2][1]).item()


def _bad_rotated(**change: Any) -> Any:
    x = mx.ones((1, 1, 64))
    q, kv = (random_quantized(n, 64, mx.float32, mx.random.key(n), 64, 4) for n in (64, 32))
    args: dict[str, Any] = {"x": x, "weight": None, "projections": [q, kv, kv], "heads": 2, "kv_heads": 1,
                            "dims": 32}
    args.update(change)
    return lambda: gkk.quantized_norm_rope_projections(**args)


@pytest.mark.parametrize("call, says", [
    (_bad_rotated(x=mx.ones((1, 64))), "x must be (B, L, K)"),
    (_bad_rotated(heads=3), "not heads=3 heads"),
    (_bad_rotated(kv_heads=2), "expected heads * D = 64 and kv_heads * D = 64"),
    (_bad_rotated(dims=33), "dims must be a positive even int"),
    (_bad_rotated(offset=mx.array([1, 2])), "offset must be an int or an integer array of 1 or 1"),
    (_bad_rotated(projections=[]), "3 (weight, scales, biases) triples"),
    (_bad_rotated(base=None), "exactly one of base and freqs"),
])
def test_the_rotating_kernel_refuses_bad_arguments_by_name(call: Any, says: str) -> None:
    with pytest.raises(gk.KernelError) as raised:
        call()
    assert raised.value.operation == "quantized_norm_rope_projections" and says in str(raised.value)
    queries, keys, values = _bad_rotated()()  # MLX still usable
    assert (queries.shape, keys.shape, values.shape) == ((1, 2, 1, 32), (1, 1, 1, 32), (1, 1, 32))


def test_the_fused_prologue_saves_one_launch_a_block() -> None:
    from graphkern.models import kernel_names

    counts = {}
    for fused in (True, False):
        model = _quantized_model("llama", 4, 64)
        names = [n for n in kernel_names() if fused or n != "quantized_norm_rope_projections"]
        gk.patch(model, kernels=names)
        counts[fused] = decode_launches(model).total
    assert counts[False] - counts[True] == len(model.model.layers)


def test_the_rotated_prologue_names_a_bias_it_cannot_add() -> None:
    case = rotated_case((1, 1, 128), mx.float32, mx.random.key(0))
    rows = [m[0].shape[0] for m in case.args[2]]
    good = [mx.zeros((n,)) for n in rows]
    for biases, says in [(good[:2], "biases must be 3 arrays"),
                         ([good[0], mx.zeros((rows[1] + 1,)), good[2]], "the keys' bias is"),
                         ([good[0], good[1], good[2].astype(mx.float16)], "the values' bias is")]:
        with pytest.raises(gk.KernelError, match=says) as found:
            gkk.quantized_norm_rope_projections(*case.args, **case.kwargs, biases=biases)
        assert found.value.operation == "quantized_norm_rope_projections"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_output_layer_takes_a_tokens_logits_through_the_product_kernel(
        arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's own ``lm_head`` and Qwen 3's tied embedding (``as_linear``): patched onto
    ``quantized_matvec`` (the embedding's lookup stays stock's), a decoding step's logits equal
    stock's, a decode step on a GPU's routes launches the kernel once more than its blocks do, and
    unpatch puts the stock layers back. Other quantized projections are not taken by the rule."""
    stock, patched = _quantized_model(arch, 4, 64), _quantized_model(arch, 4, 64)
    patched.update(stock.parameters())
    report = {p.path: p.kernel for p in gk.patch(patched, kernels="all")}
    output = "lm_head" if arch == "llama" else "model.embed_tokens"
    assert report[output] == "quantized_matvec"
    assert not any(path.endswith("_proj") for path in report)
    assert type(patched.model.layers[0].self_attn.o_proj) is nn.QuantizedLinear
    for ours, theirs in zip(_logits(patched), _logits(stock)):
        assert mx.array_equal(ours, theirs).item()
    monkeypatch.setattr(routes, "on_gpu_backend", lambda: True)
    kinds = decode_launches(patched).kinds
    assert kinds["gk_quantized_matvec"] == 2 * len(patched.model.layers) + 1
    gk.unpatch(patched)
    assert type(patched.model.embed_tokens) is nn.QuantizedEmbedding
    assert arch != "llama" or type(patched.lm_head) is nn.QuantizedLinear


def test_the_default_patch_leaves_the_opt_in_product_kernel_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gk.patch(model)`` takes every kernel but the opt-in ``quantized_matvec``: the blocks decode
    on the fused kernels with stock's output and down products, the output layer stays stock, and
    the logits equal stock's."""
    stock, patched = _quantized_model("llama", 4, 64), _quantized_model("llama", 4, 64)
    patched.update(stock.parameters())
    report = {p.path: p.kernel for p in gk.patch(patched)}
    assert "lm_head" not in report and "quantized_matvec" not in report.values()
    assert type(patched.lm_head) is nn.QuantizedLinear
    calls = spy_on_kernels(monkeypatch, KERNELS)
    for ours, theirs in zip(_logits(patched), _logits(stock)):
        assert mx.array_equal(ours, theirs).item()
    assert set(calls) == DECODING["llama"] - {"quantized_matvec"}
    monkeypatch.setattr(routes, "on_gpu_backend", lambda: True)
    assert "gk_quantized_matvec" not in decode_launches(patched).kinds


def test_an_output_layer_the_kernel_cannot_read_stays_stock() -> None:
    """3-bit weights: no rule takes the output layer or the embedding."""
    model = _quantized_model("llama", 3, 64)
    report = {p.path: p.kernel for p in gk.patch(model)}
    assert "lm_head" not in report and "model.embed_tokens" not in report
    assert type(model.lm_head) is nn.QuantizedLinear
