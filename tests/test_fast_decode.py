"""Fast decoding paths against the plain ones: the lean decode step (`fast_decode`, Python and C++) against
`GPT.hidden_states` and the engine's plain forward (the kernels themselves, per build: tests/test_kernels.py).

The lean step runs the same ops as the plain forward, so its hidden states must be equal to the bit; the packed
kernel against torch's own bf16 linear differs only by rounding order (logits within 2e-2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import tiny_model

import gptlab.generation.engine as engine_module
import gptlab.generation.fast_decode as fast_decode
from gptlab.generation import generate
from gptlab.generation.fast_decode import _native_weights, decode_hidden, supports
from gptlab.generation.packed_linear import PackedLinears, avx2_packed, forget_packed
from gptlab.kernels import avx2_ops, kernel_builds
from gptlab.kv_cache import KVCache
from gptlab.lora import LoRASpec, add_lora
from gptlab.quantize import QuantizedLinear, quantize_model

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


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("build", ["avx2", "avx512"])
def test_every_build_runs_the_quantized_native_step(build: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpt2_decode` is in every kernel build: given the same packed weights, each build's C++ step gives the lean
    step's numbers to the bit (the lean step's Linears run the AVX2 build; the builds agree on int8/int4)."""
    ops = kernel_builds().get(build)
    if ops is None:
        pytest.skip(f"gptlab's {build} kernels are not available here")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # QuantizedLinear packs
    monkeypatch.setattr(fast_decode, "avx2_ops", lambda: ops)
    model = quantize_model(gpt2_like(n_embd=64).eval(), mode, 32 if mode == "int4" else None)
    assert _native_weights(model) is not None
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
