"""Fast decoding paths against the plain ones: gptlab's AVX2 Linear kernel against float64 matmuls, and the lean
decode step (`fast_decode`, Python and C++) against `GPT.hidden_states` and the engine's plain forward.

Tolerances: the kernel accumulates in fp32 and rounds once, so fp32 outputs are within ~1e-5 of float64 (relative
to the largest output) and bf16 ones within one bf16 rounding (2**-8 relative). The lean step runs the same ops as
the plain forward, so its hidden states must be equal to the bit; the packed kernel against torch's own bf16
linear differs only by rounding order (logits within 2e-2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import gptlab.generation.engine as engine_module
from gptlab.generation import generate
from gptlab.generation.fast_decode import _native_weights, decode_hidden, supports
from gptlab.generation.packed_linear import PackedLinears, avx2_packed, forget_packed
from gptlab.kernels import avx2_ops
from gptlab.kv_cache import KVCache
from gptlab.lora import LoRASpec, add_lora
from gptlab.quantize import (
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    """The built kernels (once per machine, cached), or a skip saying why there are none."""
    built = avx2_ops()
    if built is None:
        pytest.skip("gptlab's AVX2 kernels are not available here (no AVX2 CPU, no C++ compiler, or the build "
                    "failed: see the warning)")
    return built


def gpt2_like(**kw: object) -> nn.Module:
    """A tiny model of the GPT-2 family: pre-norm LayerNorm blocks, GELU MLP, learned positions."""
    kw = {"n_kv_head": None, **kw}
    return tiny_model(position="learned", vocab_size=97, norm="layernorm", mlp="gelu", bias=True, **kw)


# ---------------------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 20), N=st.integers(1, 70), K=st.integers(1, 70), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_kernel_matches_a_float64_matmul(ops, M: int, N: int, K: int, bias: bool,  # noqa: ANN001
                                         dtype: torch.dtype, seed: int) -> None:
    """Any shape (panels padded, row tiles of 1-6, the k tail) gives x @ W.T + b to one rounding of the dtype."""
    g = torch.Generator().manual_seed(seed)
    W, x = torch.randn(N, K, generator=g).to(dtype), torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    y = ops.linear(x, ops.pack(W), None, b, N)
    ref = x.double() @ W.double().T + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (M, N)
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert (y.double() - ref).abs().max() <= tol * max(ref.abs().max().item(), 1.0)


def test_kernel_keeps_leading_dims_and_reads_fp32_bias_under_bf16(ops) -> None:  # noqa: ANN001
    W = torch.randn(40, 24).bfloat16()
    x = torch.randn(2, 3, 24).bfloat16()
    b = torch.randn(40)
    y = ops.linear(x, ops.pack(W), None, b, 40)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    ref = x.double() @ W.double().T + b.double()
    assert (y.double() - ref).abs().max() <= 2**-8 * ref.abs().max()


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 14), N=st.integers(1, 70), K=st.integers(1, 8), group=st.sampled_from([2, 4, 32]),
       mode=st.sampled_from(["int8", "int4"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_integer_kernels_equal_the_dequantized_weight_in_float64(ops, M: int, N: int, K: int, group: int,  # noqa: ANN001
                                                                  mode: str, dtype: torch.dtype, seed: int) -> None:
    """int8 (row scales) and int4 (nibbles, a scale and zero per group, groups of 2 to 32 columns) through the
    kernel: the dequantized weight (the quantize module's own formula) times x in 16-bit fixed point (within its
    rounding bound), rounded once to x's dtype. Row tiles of 1-6 and padded panels are all reached."""
    g = torch.Generator().manual_seed(seed)
    K = K * group if mode == "int4" else K * 10  # int4: whole groups; int8: column pairs
    W, x, b = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g).to(dtype), torch.randn(N, generator=g)
    if mode == "int8":
        q, scale = quantize_int8(W)
        y, dense = ops.linear(x, ops.pack_int8(q), scale, b, N), dequantize_int8(q, scale)
    else:
        q, scale, zero = quantize_int4(W, group)
        packed, qparams = ops.pack_int4(q, scale, zero)
        y, dense = ops.linear(x, packed, qparams, b, N), dequantize_int4(q, scale, zero)
    ref = x.double() @ dense.double().T + b.double()
    assert y.dtype == dtype and y.shape == (M, N)
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    bound = tol * max(ref.abs().max().item(), 1.0)
    # x rounded to 16-bit fixed point: each x[m, k] within max|x[m]| / 65534
    bound = bound + (x.double().abs().amax(dim=1, keepdim=True) / 65534) @ dense.double().abs().sum(1)[None]
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_kernel_refuses_a_mismatched_input(ops) -> None:  # noqa: ANN001
    packed = ops.pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="input has 9 features, the weight 8"):
        ops.linear(torch.randn(1, 9), packed, None, None, 16)
    q, scale = quantize_int8(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="int8 and int4 weights take qparams"):
        ops.linear(torch.randn(1, 8), ops.pack_int8(q), None, None, 16)


# ---------------------------------------------------------------------------------------------------------------
# The lean decode step
# ---------------------------------------------------------------------------------------------------------------
def test_supports_only_the_gpt2_family() -> None:
    assert supports(gpt2_like())
    assert not supports(tiny_model(position="rope"))  # RoPE: the plain forward
    assert not supports(tiny_model(position="learned", vocab_size=97))  # RMSNorm, SwiGLU, grouped heads
    assert not supports(gpt2_like(n_kv_head=2))
    dropout = gpt2_like(dropout=0.1)
    assert supports(dropout) and not supports(dropout.train())


def _steps(model: nn.Module, decode, lengths: list[int], steps: int = 4) -> torch.Tensor:  # noqa: ANN001
    """Hidden states of `steps` decode steps over rows whose caches hold `lengths` tokens."""
    torch.manual_seed(1)
    cache = KVCache(model.config, len(lengths), 32, dtype=torch.float32)
    with torch.inference_mode():
        model.hidden_states(torch.randint(0, 97, (len(lengths), max(lengths))), kv_cache=cache)
        cache.lengths.copy_(torch.tensor(lengths))  # rows of different lengths: per-row positions and masks
        out = [decode(model, torch.randint(0, 97, (len(lengths), 1)), cache) for _ in range(steps)]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[5], [5, 5], [7, 2, 4]])
def test_lean_step_equals_the_plain_forward(dtype: torch.dtype, lengths: list[int]) -> None:
    model = gpt2_like().to(dtype)
    plain = _steps(model, lambda m, idx, cache: m.hidden_states(idx, kv_cache=cache), lengths)
    lean = _steps(model, lambda m, idx, cache: decode_hidden(m, idx, cache, native=False), lengths)
    assert torch.equal(plain, lean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[5], [27, 27], [7, 2, 4]])
def test_native_step_equals_the_lean_one(ops, dtype: torch.dtype, lengths: list[int]) -> None:  # noqa: ANN001
    """The C++ step does the lean step's ops on the same packed weights: equal to the bit where rows differ in
    length (a mask: SDPA, as the lean step); rows of one length take the step's own attention over the fp32
    cache, whose sums run in another order: within fp32 rounding (a bf16 model rounds its output to bf16)."""
    model = gpt2_like().to(dtype)
    packed = PackedLinears(model)
    assert all(avx2_packed(m) is None for m in packed.modules)  # outside active(): plain forwards
    with packed.active():
        assert all(avx2_packed(m) is not None for m in packed.modules)
        lean = _steps(model, lambda m, idx, cache: decode_hidden(m, idx, cache, native=False), lengths)
        native = _steps(model, lambda m, idx, cache: decode_hidden(m, idx, cache), lengths)
    if len(set(lengths)) > 1:
        assert torch.equal(lean, native)
    else:
        tol = 2**-6 if dtype == torch.bfloat16 else 1e-5
        assert (lean.float() - native.float()).abs().max() <= tol * lean.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_native_step_equals_the_lean_one(ops, mode: str, dtype: torch.dtype,  # noqa: ANN001
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """int8/int4 Linears whose CPU forward is the AVX2 kernel go into the C++ step as (packed, qparams): the
    same numbers as calling each QuantizedLinear from the lean step, and within quantization error of the float
    model."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # the kernel's CPUs
    model = quantize_model(gpt2_like(n_embd=64).to(dtype).eval(), mode, 32 if mode == "int4" else None)
    assert all(m.avx2_weights() is not None for m in model.modules() if isinstance(m, QuantizedLinear))
    assert _native_weights(model) is not None  # the C++ step runs
    lean = _steps(model, lambda m, idx, cache: decode_hidden(m, idx, cache, native=False), [7, 2, 4])
    native = _steps(model, lambda m, idx, cache: decode_hidden(m, idx, cache), [7, 2, 4])
    assert torch.equal(lean, native)


def test_native_step_is_skipped_when_a_norm_has_another_epsilon(ops) -> None:  # noqa: ANN001
    """The C++ step takes one epsilon for every norm: a block whose ln_2 differs keeps the lean step."""
    model = gpt2_like()
    with PackedLinears(model).active():
        assert _native_weights(model) is not None
        model.transformer.h[1].ln_2.eps = 1e-3
        assert _native_weights(model) is None


def test_lean_step_keeps_a_lora_layers_own_forward() -> None:
    """Linears are called as modules, so an adapter's low-rank update is not dropped."""
    model = gpt2_like()
    add_lora(model, LoRASpec(rank=2, targets=("q", "v")))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)  # a non-zero update: the test could fail
    plain = _steps(model, lambda m, idx, cache: m.hidden_states(idx, kv_cache=cache), [4, 6])
    lean = _steps(model, lambda m, idx, cache: decode_hidden(m, idx, cache), [4, 6])
    assert torch.equal(plain, lean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_greedy_tokens_with_and_without_the_lean_step(dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = gpt2_like(block_size=64).to(dtype)
    idx = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(engine_module, "decode_hidden", lambda *a: calls.append(1) or decode_hidden(*a))
    fast = generate(model, idx, 24, temperature=0)
    assert len(calls) == 23  # every step after the prefill took the lean path
    monkeypatch.setattr(engine_module, "supports", lambda m: False)
    assert torch.equal(fast, generate(model, idx, 24, temperature=0))


def test_packed_kernel_logits_match_torchs_linear(ops) -> None:  # noqa: ANN001
    """bf16 weights on the kernel against torch's own bf16 F.linear (the unpacked model): same maths, rounding
    order aside."""
    model = gpt2_like().to(torch.bfloat16)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(idx)[0].float()
        packed = PackedLinears(model)
        assert packed.packs and all(avx2_packed(m) is None for m in packed.modules)
        with packed.active():
            fast = model(idx)[0].float()
    forget_packed(model)
    assert (fast - plain).abs().max() <= 2e-2 * plain.abs().max()
