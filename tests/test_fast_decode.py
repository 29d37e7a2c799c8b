"""Fast decoding paths against the plain ones, for every model family and on every kernel build this machine can
run (whichever one the dispatch would pick): gptlab's Linear kernel against float64 matmuls, and the lean decode
step (`fast_decode`, Python and C++) against `GPT.hidden_states` and the engine's plain forward.

Tolerances: the kernel accumulates in fp32 and rounds once, so fp32 outputs are within ~1e-5 of float64 (relative
to the largest output) and bf16 ones within one bf16 rounding (2**-8 relative). The lean step runs the same ops as
the plain forward, so its hidden states must be equal to the bit. The C++ step keeps values in fp32 and rounds to
a bf16 model's dtype where the lean step holds a bf16 tensor, but a norm or rotation once rather than per op: fp32
within 1e-5, bf16 within a few roundings (2**-5 of the largest value after four steps). The packed kernel against
torch's own bf16 linear differs only by rounding order (logits within 2e-2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from families import FAMILIES
from families import build as family_model
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import gptlab.generation.engine as engine_module
from gptlab.generation import generate, native_decode
from gptlab.generation.fast_decode import LEAN_SWITCHES, decode_hidden, supports, unknown_switches
from gptlab.generation.packed_linear import PackedLinears, forget_packed, kernel_packed
from gptlab.kernels import kernel_builds
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


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def build_name(request: pytest.FixtureRequest) -> str:
    """Each of gptlab's kernel builds this machine runs (built once per machine, cached); a skip saying why where
    a build is not there."""
    if request.param not in kernel_builds():
        pytest.skip(f"gptlab's {request.param} kernels do not run here (the CPU lacks them, no C++ compiler, or the "
                    "build failed: see the warning)")
    return request.param


@pytest.fixture(scope="module")
def ops(build_name: str):  # noqa: ANN201
    return kernel_builds()[build_name]


@pytest.fixture
def on_kernel(build_name: str, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """That build made the dispatch's choice for the test, whichever one it would pick here."""
    monkeypatch.setenv("GPTLAB_KERNEL", build_name)
    return kernel_builds()[build_name]


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
# The lean decode step: every family
# ---------------------------------------------------------------------------------------------------------------
ALL_FAMILIES = ["gpt2", *FAMILIES]


def model_of(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return (gpt2_like() if family == "gpt2" else family_model(family)).to(dtype)


def test_supports_every_family_and_refuses_what_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(supports(model_of(f)) for f in ALL_FAMILIES)
    dropout = gpt2_like(dropout=0.1)
    assert supports(dropout) and not supports(dropout.train())  # dropout runs in training only
    model = model_of("llama")
    model.transformer.h[1].ln_2 = nn.GroupNorm(1, model.config.n_embd)  # a module the step does not know
    assert not supports(model)
    # a switch added to GPTConfig later, which the step has not been taught: refused while it is not at its default
    monkeypatch.setattr("gptlab.generation.fast_decode.LEAN_SWITCHES", LEAN_SWITCHES - {"attn_softcap"})
    gemma = model_of("gemma2")
    assert unknown_switches(gemma.config) == ["attn_softcap"] and not supports(gemma)
    assert supports(model_of("llama"))  # the switch at its default: nothing is ignored


def _steps(model: nn.Module, decode, lengths: list[int], steps: int = 4) -> torch.Tensor:  # noqa: ANN001
    """Hidden states of `steps` decode steps over rows whose caches hold `lengths` tokens."""
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    cache = KVCache(model.config, len(lengths), 32, dtype=torch.float32)
    with torch.inference_mode():
        model.hidden_states(torch.randint(0, vocab, (len(lengths), max(lengths))), kv_cache=cache)
        cache.lengths.copy_(torch.tensor(lengths))  # rows of different lengths: per-row positions and masks
        out = [decode(model, torch.randint(0, vocab, (len(lengths), 1)), cache) for _ in range(steps)]
    return torch.cat(out, dim=1)


def plain(m: nn.Module, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return m.hidden_states(idx, kv_cache=cache)


def lean(m: nn.Module, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return decode_hidden(m, idx, cache, native=False)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, fp32_tol: float = 1e-5) -> bool:
    tol = 2**-5 if dtype == torch.bfloat16 else fp32_tol
    return bool((a.float() - b.float()).abs().max() <= tol * a.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_lean_step_equals_the_plain_forward(family: str, dtype: torch.dtype) -> None:
    """The same ops as the general forward: equal to the bit, rows of one length and of several (masks; windows
    that cut in once a row is past `sliding_window`)."""
    model = model_of(family, dtype)
    for lengths in ([5], [7, 2, 12]):
        assert torch.equal(_steps(model, plain, lengths), _steps(model, lean, lengths)), lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_native_step_equals_the_lean_one(on_kernel, family: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The C++ step over the same packed weights: within fp32 rounding of the lean step (a bf16 model: within a
    few bf16 roundings), for rows of one length and of several."""
    model = model_of(family, dtype)
    packed = PackedLinears(model)
    assert all(kernel_packed(m) is None for m in packed.modules)  # outside active(): plain forwards
    with packed.active():
        assert all(kernel_packed(m) is not None for m in packed.modules)
        for lengths in ([5], [27, 27], [7, 2, 12]):
            want = _steps(model, lean, lengths)
            assert native_decode.weights(model, KVCache(model.config, 1, 8)) is not None  # the C++ step runs
            assert _close(want, _steps(model, decode_hidden, lengths), dtype), lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_quantized_native_step_equals_the_lean_one(on_kernel, family: str, mode: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """int8/int4 Linears whose CPU forward is gptlab's kernel go into the C++ step as (packed, qparams): the
    lean step calling each QuantizedLinear, within rounding (fp32: an input that differs by a rounding may put a
    value of the kernel's 16-bit fixed point one step over, 2**-15 of the row's largest)."""
    model = quantize_model(model_of(family, dtype), mode, 32 if mode == "int4" else None)
    assert all(m.kernel_weights() is not None for m in model.modules() if isinstance(m, QuantizedLinear))
    assert native_decode.weights(model, KVCache(model.config, 1, 8)) is not None
    want = _steps(model, lean, [7, 2, 4])
    assert _close(want, _steps(model, decode_hidden, [7, 2, 4]), dtype, fp32_tol=2**-11)


def test_native_step_is_skipped_when_a_norm_has_another_epsilon(on_kernel) -> None:  # noqa: ANN001
    """The C++ step takes the config's epsilon for every norm: a block whose ln_2 differs keeps the lean step."""
    model = gpt2_like()
    cache = KVCache(model.config, 1, 8)
    with PackedLinears(model).active():
        assert native_decode.weights(model, cache) is not None
        model.transformer.h[1].ln_2.eps = 1e-3
        assert native_decode.weights(model, cache) is None


def test_native_step_needs_every_linear_on_the_kernel_and_an_fp32_cache(on_kernel, monkeypatch) -> None:  # noqa: ANN001
    model = model_of("llama")
    with PackedLinears(model).active():
        assert native_decode.weights(model, KVCache(model.config, 1, 8, dtype=torch.bfloat16)) is None
    monkeypatch.setenv("GPTLAB_KERNEL", "torch")  # the dispatch keeps PyTorch's paths: no packed gptlab weights
    model = model_of("llama")
    with PackedLinears(model).active():
        assert all(kernel_packed(m) is None for m in model.modules())
        assert native_decode.weights(model, KVCache(model.config, 1, 8)) is None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lean_step_keeps_a_lora_layers_own_forward(family: str) -> None:
    """Linears are called as modules, so an adapter's low-rank update is not dropped."""
    model = model_of(family)
    add_lora(model, LoRASpec(rank=2, targets=("q", "v")))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)  # a non-zero update: the test could fail
    assert torch.equal(_steps(model, plain, [4, 6]), _steps(model, decode_hidden, [4, 6]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_engine_greedy_tokens_with_and_without_the_lean_step(family: str, dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine decodes with the lean step (and the C++ one where the dispatch puts every Linear on gptlab's
    kernel) and picks the same greedy tokens as with the plain forward, past a sliding window too."""
    model = model_of(family, dtype)
    idx = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(engine_module, "decode_hidden", lambda *a: calls.append(1) or decode_hidden(*a))
    fast = generate(model, idx, 24, temperature=0)
    assert len(calls) == 23  # every step after the prefill took the lean path
    monkeypatch.setattr(engine_module, "supports", lambda m: False)
    assert torch.equal(fast, generate(model, idx, 24, temperature=0))


def test_packed_kernel_logits_match_torchs_linear(on_kernel) -> None:  # noqa: ANN001
    """bf16 weights on the kernel against torch's own bf16 F.linear (the unpacked model): same maths, rounding
    order aside."""
    model = gpt2_like().to(torch.bfloat16)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain_logits = model(idx)[0].float()
        packed = PackedLinears(model)
        assert packed.packs and all(kernel_packed(m) is None for m in packed.modules)
        with packed.active():
            fast = model(idx)[0].float()
    forget_packed(model)
    assert (fast - plain_logits).abs().max() <= 2e-2 * plain_logits.abs().max()
