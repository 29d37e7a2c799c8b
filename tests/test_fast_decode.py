"""Fast decoding paths against the plain ones, for every model family and on every kernel build this machine can
run (whichever one the dispatch would pick): the lean decode step (`fast_decode`, Python and C++) against
`GPT.hidden_states` and the engine's plain forward. The kernels themselves are tested in test_kernels.py.

The lean step runs the same ops as the plain forward, so its hidden states must be equal to the bit. The C++ step
keeps values in fp32 and rounds to a bf16 model's dtype where the lean step holds a bf16 tensor: fp32 within 1e-5
(sums in another order), bf16 equal but for the odd value rounded the other way (within 2**-7 of the largest
value after four steps). The packed kernel against torch's own bf16 linear differs only by rounding order (logits within
2e-2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from families import ALL_FAMILIES, build, gpt2_like, model_of
from helpers import decode_rows_beside, within_step_rounding

import gptlab.generation.engine as engine_module
from gptlab.generation import Engine, generate, native_decode
from gptlab.generation.fast_decode import (
    LEAN_SWITCHES,
    decode_greedy,
    decode_hidden,
    decode_logits,
    lean_step_exact,
    unknown_switches,
)
from gptlab.generation.packed_linear import PackedLinears, forget_packed, kernel_packed
from gptlab.kv_cache import KVCache
from gptlab.lora import LoRASpec, add_lora
from gptlab.quantize import QuantizedLinear, quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------------
# The lean decode step: every family
# ---------------------------------------------------------------------------------------------------------------
def test_supports_every_family_and_refuses_what_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(lean_step_exact(model_of(f)) for f in ALL_FAMILIES)
    dropout = gpt2_like(dropout=0.1)
    assert lean_step_exact(dropout) and not lean_step_exact(dropout.train())  # dropout runs in training only
    model = model_of("llama")
    model.transformer.h[1].ln_2 = nn.GroupNorm(1, model.config.n_embd)  # a module the step does not know
    assert not lean_step_exact(model)
    # a switch added to GPTConfig later, which the step has not been taught: refused while it is not at its default
    monkeypatch.setattr("gptlab.generation.fast_decode.LEAN_SWITCHES", LEAN_SWITCHES - {"attn_softcap"})
    gemma = model_of("gemma2")
    assert unknown_switches(gemma.config) == ["attn_softcap"] and not lean_step_exact(gemma)
    assert lean_step_exact(model_of("llama"))  # the switch at its default: nothing is ignored


def _steps(model: nn.Module, decode, lengths: list[int], steps: int = 4,  # noqa: ANN001
           stored: torch.dtype = torch.float32) -> torch.Tensor:
    """Hidden states of `steps` decode steps over rows whose caches hold `lengths` tokens (keys and values stored
    as `stored`, attended in fp32)."""
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    cache = KVCache(model.config, len(lengths), 32, dtype=stored, attend_dtype=torch.float32)
    with torch.inference_mode():
        model.hidden_states(torch.randint(0, vocab, (len(lengths), max(lengths))), kv_cache=cache)
        cache.lengths.copy_(torch.tensor(lengths))  # rows of different lengths: per-row positions and masks
        out = [decode(model, torch.randint(0, vocab, (len(lengths), 1)), cache) for _ in range(steps)]
    return torch.cat(out, dim=1)


def plain(m: nn.Module, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return m.hidden_states(idx, kv_cache=cache)


def lean(m: nn.Module, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return decode_hidden(m, idx, cache, native=False)


_close = within_step_rounding


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
    """The C++ step over the same packed weights: within fp32 rounding of the lean step (a bf16 model: but for
    the odd bf16 rounding), for rows of one length and of several."""
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
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
@pytest.mark.parametrize("n_embd", [36, 40])
def test_native_step_at_widths_that_are_not_whole_vectors(on_kernel, family: str, n_embd: int,  # noqa: ANN001
                                                         dtype: torch.dtype) -> None:
    """Widths off the builds' vectors (36: not a multiple of AVX2's 8 lanes; 40: of AVX-512's 16), heads of 18 or
    20, an MLP of 106 or 118: the norms', activations' and products' tails, against the lean step."""
    shape = dict(n_embd=n_embd, n_head=2, mlp_hidden=n_embd * 3 - 2)
    if family == "gpt2":
        model = gpt2_like(**shape).to(dtype)
    else:
        model = build(family, **shape, n_kv_head=1, head_dim=n_embd // 2).to(dtype)
    packed = PackedLinears(model)
    with packed.active():
        for lengths in ([5], [7, 2, 12]):
            assert native_decode.weights(model, KVCache(model.config, 1, 8)) is not None  # the C++ step runs
            assert _close(_steps(model, lean, lengths), _steps(model, decode_hidden, lengths), dtype), lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_native_step_prefills_prompt_parts_beside_decoding_rows(on_kernel, family: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """`decode_rows`: one C++ call feeds a row its next token and other rows prompt parts after what they hold (in
    scattered cache rows, one of them empty; parts past a sliding window): each row's hidden states are those of
    one forward over its whole sequence (within the C++ step's rounding, as above), and each cache row holds its
    keys after it."""
    model = model_of(family, dtype)
    gen = torch.Generator().manual_seed(3)
    held = {3: 9, 0: 4, 2: 0}  # cache row -> tokens it holds; then the tokens each is fed
    fed = {3: 1, 0: 6, 2: 11}
    seqs = {r: torch.randint(0, model.config.vocab_size, (held[r] + fed[r],), generator=gen).tolist() for r in held}
    cache, hidden = decode_rows_beside(model, held, fed, seqs)
    with torch.inference_mode(), PackedLinears(model).active():
        start = 0
        for r in fed:  # against one forward over the row's whole sequence, attending in fp32 as the engine's do
            alone = KVCache(model.config, 1, 24, dtype=cache.k.dtype, attend_dtype=torch.float32)
            whole = model.hidden_states(torch.tensor([seqs[r]]), kv_cache=alone)  # (the same packed Linears)
            assert _close(whole[0, held[r]:], hidden[start : start + fed[r]], dtype), r
            start += fed[r]
            n = len(seqs[r])  # the row's cache holds what that forward wrote
            assert _close(alone.k[:, 0, :, :n], cache.k[:, r, :, :n], dtype), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_quantized_native_step_equals_the_lean_one(on_kernel, family: str, mode: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """int8/int4 Linears whose CPU forward is gptlab's kernel go into the C++ step as (packed, qparams): the
    lean step calling each QuantizedLinear, within rounding (fp32: an input that differs by a rounding may put a
    value of the kernel's rounded activations one step over: int8's 16-bit fixed point 2**-15 of the row's largest,
    int4's int8 blocks 1/127 of the block's largest, rare enough that the step's outputs stay within 2**-11)."""
    model = quantize_model(model_of(family, dtype), mode, 32 if mode == "int4" else None)
    assert all(m.kernel() is not None for m in model.modules() if isinstance(m, QuantizedLinear))
    assert native_decode.weights(model, KVCache(model.config, 1, 8)) is not None
    want = _steps(model, lean, [7, 2, 4])
    assert _close(want, _steps(model, decode_hidden, [7, 2, 4]), dtype, fp32_tol=2**-11)


@pytest.mark.parametrize(("family", "weights"), [(f, d) for f in [*ALL_FAMILIES, "shifted", "normed"]
                                                 for d in ("float32", "bfloat16")]
                         + [(f, m) for f in ("gpt2", "llama", "gemma2") for m in ("int8", "int4")])
def test_the_cpp_steps_own_embedding_and_head_give_the_models_bits(on_kernel, family: str, weights: str) -> None:  # noqa: ANN001
    """The C++ step embeds the tokens itself (wte, Gemma's scale, token shift's first point, wpe, an embedding norm)
    and runs the LM head on its build: the same bits as the model's embedding before the call and its head's own
    forward after it, for rows of several lengths, every row's logits or some rows' (the engine's running ones).
    An embedding norm is the C++ step's own (its sums in another order than ATen's): within its rounding."""
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    if family in ("shifted", "normed"):  # GPT-2's shape with token shift, or with an embedding norm (BLOOM's)
        model = gpt2_like(**{"token_shift" if family == "shifted" else "embedding_norm": True}).to(dtype)
        with torch.no_grad():  # away from their identity values: the test could fail
            nn.init.uniform_(model.transformer.shift.mix if family == "shifted" else model.transformer.ln_emb.weight,
                             0.2, 0.8)
    else:
        model = model_of(family, dtype)
    same = (lambda a, b: _close(a, b, dtype)) if family == "normed" else torch.equal
    if weights in ("int8", "int4"):
        model = quantize_model(model, weights, 32 if weights == "int4" else None)
    torch.manual_seed(2)
    lengths, vocab = [7, 2, 12], model.config.vocab_size
    prompt = torch.randint(0, vocab, (len(lengths), max(lengths)))
    with torch.inference_mode(), PackedLinears(model).active():
        caches = []
        for _ in range(3):
            cache = KVCache(model.config, len(lengths), 32, attend_dtype=torch.float32)
            model.hidden_states(prompt, kv_cache=cache)
            cache.lengths.copy_(torch.tensor(lengths))
            caches.append(cache)
        own = native_decode.weights(model, caches[0])
        assert own is not None and own.front is not None and own.head is not None  # both ends in the call
        outside = dataclasses.replace(own, front=None, head=None)
        for step in range(3):
            idx = torch.randint(0, vocab, (len(lengths), 1))
            rows = [2, 0] if step == 1 else None
            got = decode_logits(model, idx, caches[0], own, rows)
            h = decode_hidden(model, idx, caches[1], outside)
            assert same(got, model.logits(h[:, -1] if rows is None else h[rows, -1])), step
            assert same(decode_hidden(model, idx, caches[2], dataclasses.replace(own, head=None)), h), step
        assert same(caches[0].k, caches[1].k)
        if caches[0].shifted is not None:  # the embeddings' kept vectors too
            assert torch.equal(caches[0].shifted, caches[1].shifted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [*ALL_FAMILIES, "shifted"])
def test_greedy_steps_in_one_call_pick_what_single_steps_pick(on_kernel, family: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """`decode_greedy` (a draft model's guesses: steps of the C++ step in one call, each fed the argmax of the one
    before) picks what one step at a time picks from the head's raw logits (fp32: the same bits, so the same argmax;
    bf16: a token whose rounded logit is the row's largest, the call comparing them before rounding), and leaves
    the cache as those steps do. A sliding window's masks: it declines (None)."""
    model = gpt2_like(token_shift=True).to(dtype) if family == "shifted" else model_of(family, dtype)
    torch.manual_seed(4)
    prompt = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.inference_mode(), PackedLinears(model).active():
        caches = []
        for _ in range(2):
            cache = KVCache(model.config, 1, 32, attend_dtype=torch.float32)
            model.hidden_states(prompt, kv_cache=cache)
            caches.append(cache)
        own = native_decode.weights(model, caches[0])
        picks = decode_greedy(model, 5, caches[0], own, 6)
        if model.config.sliding_window is not None:
            assert picks is None and int(caches[0].lengths[0]) == 9  # nothing fed
            return
        assert len(picks) == 6
        token = 5
        for pick in picks:  # one step at a time, the head's own forward on the C++ step's hidden states
            raw = model.lm_head(decode_hidden(model, torch.tensor([[token]]), caches[1], own)[0, -1]).float()
            assert raw[pick] == raw.max() and (dtype == torch.bfloat16 or pick == int(raw.argmax()))
            token = pick
        assert torch.equal(caches[0].lengths, caches[1].lengths)
        n = int(caches[0].lengths[0])
        assert torch.equal(caches[0].k[..., :n, :], caches[1].k[..., :n, :])
        if caches[0].shifted is not None:
            assert torch.equal(caches[0].shifted[:, :, :n], caches[1].shifted[:, :, :n])


_THREAD_CASES = ([(f, d) for f in ALL_FAMILIES for d in ("float32", "bfloat16")]
                 + [(f, m) for f in ("gpt2", "llama", "gemma2") for m in ("int8", "int4")])


@pytest.mark.parametrize(("family", "weights"), _THREAD_CASES)
def test_native_step_gives_the_same_bits_on_any_number_of_threads(on_kernel, family: str, weights: str) -> None:  # noqa: ANN001
    """The C++ step's threads split each product's panels and the attention's heads, every value computed as one
    thread computes it, and each does the norms and adds on its own copy: the same bits on 1, 2 and 3 threads (3:
    shares of unequal size, and more threads than this machine may have cores, where the barrier's waiters yield)."""
    model = model_of(family, torch.bfloat16 if weights == "bfloat16" else torch.float32)
    if weights in ("int8", "int4"):
        model = quantize_model(model, weights, 32 if weights == "int4" else None)
    packed = PackedLinears(model)
    before = torch.get_num_threads()
    try:
        runs = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with packed.active():
                assert native_decode.weights(model, KVCache(model.config, 1, 8)) is not None  # the C++ step runs
                runs[threads] = _steps(model, decode_hidden, [7, 2, 12])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[1], runs[2]) and torch.equal(runs[1], runs[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("mlp", "approximate"), [("gelu", "none"), ("gelu", "tanh"), ("geglu", "none"),
                                                 ("geglu", "tanh"), ("swiglu", "none"), ("relu2", "none")])
def test_native_activations_follow_atens(on_kernel, mlp: str, approximate: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The C++ step computes the MLP's activation itself (its own exp, tanh and erf): against the lean step's ATen
    ops, with the first Linear's weights scaled up so that pre-activations reach the tails (|x| up to ~10), where
    GELU's 1 + erf and silu's 1 + e^-x lose accuracy in a careless formula."""
    model = gpt2_like(mlp=mlp, gelu_approximate=approximate).to(dtype)
    with torch.no_grad():
        for b in model.transformer.h:
            b.mlp.c_fc.weight.mul_(40)
    with PackedLinears(model).active():
        want = _steps(model, lean, [7, 2, 4])
        assert _close(want, _steps(model, decode_hidden, [7, 2, 4]), dtype)


def test_native_step_is_skipped_when_a_norm_has_another_epsilon(on_kernel) -> None:  # noqa: ANN001
    """The C++ step takes the config's epsilon for every norm: a block whose ln_2 differs keeps the lean step."""
    model = gpt2_like()
    cache = KVCache(model.config, 1, 8)
    with PackedLinears(model).active():
        assert native_decode.weights(model, cache) is not None
        model.transformer.h[1].ln_2.eps = 1e-3
        assert native_decode.weights(model, cache) is None


_BF16_CACHE_CASES = ([(f, "bfloat16") for f in ALL_FAMILIES]
                     + [(f, m) for f in ("gpt2", "llama") for m in ("int8", "int4")])


@pytest.mark.parametrize(("family", "weights"), _BF16_CACHE_CASES)
def test_a_bf16_models_keys_stored_in_bf16_give_the_bits_of_an_fp32_cache(on_kernel, family: str,  # noqa: ANN001
                                                                           weights: str) -> None:
    """A bf16 model's keys and values are bf16 values, so a bf16 cache holds them exactly: the C++ step reading
    bf16, and the lean step and the plain forward (prefill) attending in fp32 after `append` widens them, compute
    to the bit what they compute over an fp32 cache."""
    model = model_of(family, torch.bfloat16)
    if weights != "bfloat16":
        model = quantize_model(model, weights, 32 if weights == "int4" else None)
    with PackedLinears(model).active():
        assert native_decode.weights(model, KVCache(model.config, 1, 8, dtype=torch.bfloat16)) is not None
        for decode in (decode_hidden, lean, plain):
            want = _steps(model, decode, [7, 2, 12])
            assert torch.equal(want, _steps(model, decode, [7, 2, 12], stored=torch.bfloat16)), decode


def test_native_step_needs_every_linear_on_the_kernel_and_a_cache_it_reads(on_kernel, monkeypatch) -> None:  # noqa: ANN001
    model = model_of("llama")
    with PackedLinears(model).active():  # an fp32 model's keys would lose bits in bf16: not that cache
        assert native_decode.weights(model, KVCache(model.config, 1, 8, dtype=torch.bfloat16)) is None
        assert native_decode.weights(model, KVCache(model.config, 1, 8, dtype=torch.float16)) is None
    model = model_of("llama", torch.bfloat16)
    with PackedLinears(model).active():
        assert native_decode.weights(model, KVCache(model.config, 1, 8, dtype=torch.float16)) is None
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


def _greedy_with_and_without_the_lean_step(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    idx = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(engine_module, "decode_logits", lambda *a, **kw: calls.append(1) or decode_logits(*a, **kw))
    fast = generate(model, idx, 24, temperature=0)
    assert len(calls) == 23  # every step after the prefill took the lean path
    monkeypatch.setattr(engine_module, "lean_step_exact", lambda m: False)
    assert torch.equal(fast, generate(model, idx, 24, temperature=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_engine_greedy_tokens_with_and_without_the_lean_step(family: str, dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine decodes with the lean step (Python: Linears on PyTorch's paths) and picks the same greedy tokens
    as with the plain forward, past a sliding window too."""
    monkeypatch.setenv("GPTLAB_KERNEL", "torch")
    _greedy_with_and_without_the_lean_step(model_of(family, dtype), monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_engine_greedy_tokens_with_and_without_the_native_step(on_kernel, family: str, dtype: torch.dtype,  # noqa: ANN001
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With every Linear on gptlab's kernel the engine's steps run in C++: the same greedy tokens as the plain
    forward."""
    model = model_of(family, dtype)
    assert Engine(model).kernels()["decode step"] == "native C++"
    _greedy_with_and_without_the_lean_step(model, monkeypatch)


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


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_linears_sent_to_a_build_run_the_native_step_in_that_build(build_name: str, family: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where whole steps were timed faster on a build than on other paths (`step_choice`), the Linears are packed
    for that build whatever the dispatch picks for their products, and the C++ step runs in that build (not in the
    dispatch's); a prefill's many rows give them their plain forward where the dispatch measured PyTorch's product
    faster at that size."""
    from gptlab.kernels import kernel_builds

    monkeypatch.setenv("GPTLAB_KERNEL", "torch")  # the dispatch's choice: PyTorch's paths
    model = model_of(family, torch.bfloat16)
    packed = PackedLinears(model, 3, path=build_name)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with packed.active():
        assert all(kernel_packed(m)[0] is kernel_builds()[build_name] for m in linears)
        native = native_decode.weights(model, KVCache(model.config, 1, 8))
        assert native is not None and native.ops is kernel_builds()[build_name]
        want = _steps(model, lean, [7, 2, 4])
        assert _close(want, _steps(model, decode_hidden, [7, 2, 4]), torch.bfloat16)
    with packed.active(many_rows=True):
        assert all(kernel_packed(m) is None for m in linears)


def test_linears_sent_to_a_build_probe_the_large_batch_choice_when_packed(build_name: str, tmp_path,  # noqa: ANN001
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch's large-batch probe, which a prefill of many rows consults, runs when the Linears are packed (a
    server's start-up), not inside the first such prefill, where it stalled every running row."""
    from gptlab.kernels import dispatch

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPTLAB_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "busy", lambda: False)
    probes = []  # PyTorch's products win every probe
    monkeypatch.setattr(dispatch, "probe", lambda kind, names, rows: probes.append(rows)
                        or {"torch": 1.0, **dict.fromkeys(names, 2.0)})
    dispatch._measured.cache_clear()
    try:
        model = model_of("llama", torch.bfloat16)
        packed = PackedLinears(model, 3, path=build_name)
        assert dispatch.BATCH in probes
        made = len(probes)
        with packed.active(many_rows=True):
            assert all(kernel_packed(m) is None for m in model.modules() if isinstance(m, nn.Linear))
        assert len(probes) == made
    finally:
        dispatch._measured.cache_clear()


def test_engine_with_its_linears_on_a_build_decodes_the_plain_forwards_tokens(build_name: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTLAB_KERNEL", "torch")
    monkeypatch.setattr(engine_module, "decode_path", lambda model, rows, cache_dtype: build_name)
    model = model_of("llama", torch.bfloat16)
    engine = Engine(model, max_batch=3)
    assert engine.kernels()["decode step"] == "native C++"
    # the C++ step's cache: a bf16 model's keys in bf16, attended in fp32; a cache the caller names is kept
    assert engine.cache.k.dtype == torch.bfloat16 and engine.cache.attend_dtype == torch.float32
    assert Engine(model, max_batch=3, cache_dtype=torch.float32).cache.k.dtype == torch.float32
    idx = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    stored_bf16 = generate(model, idx, 24, temperature=0)
    monkeypatch.setattr(engine_module, "step_cache_dtype", lambda model, path: torch.float32)
    assert torch.equal(stored_bf16, generate(model, idx, 24, temperature=0))
    _greedy_with_and_without_the_lean_step(model, monkeypatch)
