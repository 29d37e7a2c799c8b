"""Token shift (`GPTConfig.token_shift`, `gptlab.token_shift`): the forward against the maths written out, causality,
packed documents as if alone, the KV cache against whole forwards (chunks, rows at different lengths, gathered
rows), the engine, the prefix cache and speculative decoding against whole forwards, and the paths that cannot
compute it refusing it."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_rows_beside, within_step_rounding
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import GPT, GPTConfig, KVCache
from gptlab.errors import GptlabError
from gptlab.generation import Engine, NgramDrafter, PrefixCache, SamplingParams, generate_batch, native_decode
from gptlab.generation.fast_decode import decode_hidden, lean_step_exact
from gptlab.generation.packed_linear import PackedLinears
from gptlab.interop.gguf_arch import gguf_architecture
from gptlab.interop.hf import export_family
from gptlab.kv_cache import cache_bytes, masks_for
from gptlab.rope import rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 61


def shifted_model(seed: int = 0, **overrides: object) -> GPT:
    """The speedrun's kind of model (token shift on), every weight moved off its init, mixes in (-0.5, 1)."""
    torch.manual_seed(seed)
    cfg = GPTConfig.preset("speedrun-char", **{"vocab_size": VOCAB, "block_size": 48, "init_std": 0.3,
                                                "tie_embeddings": False, **overrides})
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".mix"):
                p.uniform_(-0.5, 1.0)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


MODEL = shifted_model()


def tokens(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def by_the_maths(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Logits with each shift written out: h_t + mix * (h_{t-1} - h_t), h_{-1} = 0, at the embeddings and at every
    block's MLP input (pre-norm blocks, RoPE, no cache)."""
    def shift(h: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
        before = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        return h + mix * (before - h)

    t = model.transformer
    T = idx.shape[1]
    rope = rope_tables(model.config, torch.arange(T)[None])
    x = shift(t.wte(idx), t.shift.mix)
    for block in t.h:
        x = x + block.attn(block.ln_1(x), rope, masks_for(torch.arange(T)[None], T, None, None), None)
        x = x + block.mlp(shift(block.ln_2(x), block.mlp_shift.mix))
    return model.logits(t.ln_f(x))


def test_the_forward_is_the_maths_and_a_zero_mix_is_the_model_without_it() -> None:
    idx = tokens(0, (2, 30))
    with torch.no_grad():
        logits = MODEL(idx).logits
        assert torch.allclose(logits, by_the_maths(MODEL, idx), atol=1e-5)
        plain = GPT(MODEL.config.replace(token_shift=False)).eval()
        plain.load_state_dict({k: v for k, v in MODEL.state_dict().items() if not k.endswith(".mix")})
        zeroed = shifted_model()
        for name, p in zeroed.named_parameters():
            if name.endswith(".mix"):
                p.data.zero_()
        assert torch.allclose(zeroed(idx).logits, plain(idx).logits, atol=1e-6)
        assert not torch.allclose(logits, plain(idx).logits, atol=1e-2)  # the mixes do something


def test_mixes_start_at_zero_are_adamw_vectors_and_learn() -> None:
    model = GPT(GPTConfig.preset("speedrun-char", vocab_size=VOCAB))
    mixes = {n: p for n, p in model.named_parameters() if n.endswith(".mix")}
    assert sorted(mixes) == ["transformer.h.0.mlp_shift.mix", "transformer.h.1.mlp_shift.mix",
                             "transformer.shift.mix"]
    assert all(torch.equal(p, torch.zeros(64)) for p in mixes.values())
    with torch.device("meta"):  # built for sharding: initialized by `initializers`, to zeros too
        meta = GPT(GPTConfig.preset("speedrun-char", vocab_size=VOCAB))
    assert {id(p) for p, _ in meta.initializers()} >= {id(p) for n, p in meta.named_parameters() if n.endswith(".mix")}
    kinds = model.parameter_groups_by_kind()
    assert set(mixes) <= {n for n, _ in kinds["vector"]}
    idx = tokens(1, (2, 20))
    model(idx, idx).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixes.values())


@settings(max_examples=15, deadline=None)
@given(t=st.integers(0, 22), seed=st.integers(0, 2**16))
def test_future_tokens_never_change_earlier_logits(t: int, seed: int) -> None:
    idx = tokens(seed, (2, 24))
    changed = idx.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + tokens(seed + 1, (2, 23 - t)) % (VOCAB - 1)) % VOCAB
    with torch.no_grad():
        a, b = MODEL(idx).logits, MODEL(changed).logits
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_packed_documents_are_computed_as_if_alone() -> None:
    """A document's first token mixes with nothing, not with the previous document's last."""
    idx = tokens(2, (1, 20))
    documents = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4])
    with torch.no_grad():
        packed = MODEL(idx, documents=documents).logits
        for start, stop in [(0, 7), (7, 16), (16, 20)]:
            alone = MODEL(idx[:, start:stop]).logits
            assert torch.allclose(packed[:, start:stop], alone, atol=1e-5)


@st.composite
def chunkings(draw) -> list[int]:
    chunks = [draw(st.integers(1, 10)), 1, *draw(st.lists(st.integers(1, 6), max_size=4)), 1]
    return chunks


@settings(max_examples=25, deadline=None)
@given(chunks=chunkings(), seed=st.integers(0, 2**16))
def test_cache_equals_no_cache(chunks: list[int], seed: int) -> None:
    idx = tokens(seed, (2, sum(chunks)))
    with torch.no_grad():
        full = MODEL(idx).logits
        cache = KVCache(MODEL.config, batch_size=2)
        pieces, start = [], 0
        for n in chunks:
            pieces.append(MODEL(idx[:, start : start + n], kv_cache=cache).logits)
            start += n
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-4


@settings(max_examples=20, deadline=None)
@given(lengths=st.tuples(st.integers(1, 15), st.integers(1, 15)), steps=st.lists(st.integers(1, 4), min_size=1,
       max_size=4), seed=st.integers(0, 2**16))
def test_rows_at_different_lengths_and_gathered_rows(lengths: tuple[int, int], steps: list[int], seed: int) -> None:
    """Rows prefilled apart (`rows`) to different lengths, then stepped together, and the same rows stepped again
    as a gathered cache of their own (`gather` / `scatter`): each row's logits are its whole forward's."""
    la, lb = lengths
    seqs = tokens(seed, (2, max(la, lb) + sum(steps) + 1))
    with torch.no_grad():
        cache = KVCache(MODEL.config, batch_size=2)
        got = [[MODEL(seqs[:1, :la], kv_cache=cache.rows(0, 1)).logits[0]],
               [MODEL(seqs[1:, :lb], kv_cache=cache.rows(1, 2)).logits[0]]]
        ends = [la, lb]
        for n in steps:
            logits = MODEL(torch.stack([seqs[r, ends[r] : ends[r] + n] for r in range(2)]), kv_cache=cache).logits
            for r in range(2):
                got[r].append(logits[r])
                ends[r] += n
        slots = torch.tensor([1, 0])
        part = cache.gather(slots, cache.max_len)
        logits = MODEL(torch.stack([seqs[r, ends[r] : ends[r] + 1] for r in (1, 0)]), kv_cache=part).logits
        cache.scatter(slots, part, 0, max(ends) + 1)
        for i, r in enumerate((1, 0)):
            got[r].append(logits[i])
            ends[r] += 1
        for r in range(2):
            ref = MODEL(seqs[r : r + 1, : ends[r]]).logits[0]
            assert (torch.cat(got[r]) - ref).abs().max() < 1e-4, f"row {r}"
        assert torch.equal(cache.shifted[:, 0, : ends[0]], part.shifted[:, 1, : ends[0]])


def _four_steps(model: GPT, step, lengths: list[int], stored: torch.dtype = torch.float32,  # noqa: ANN001
                attend: torch.dtype | None = None) -> tuple[torch.Tensor, KVCache]:
    """The hidden states of 4 decode steps `step(cache, idx)` over rows whose caches hold `lengths` tokens (rows of
    different lengths: each its own predecessors), and the cache after them."""
    cache = KVCache(model.config, len(lengths), 32, dtype=stored, attend_dtype=attend)
    with torch.inference_mode():
        model.hidden_states(tokens(0, (len(lengths), max(lengths))), kv_cache=cache)
        cache.lengths.copy_(torch.tensor(lengths))
        out = torch.cat([step(cache, tokens(i + 1, (len(lengths), 1))) for i in range(4)], dim=1)
    return out, cache


@pytest.mark.parametrize("block", ["pre", "parallel", "sandwich", "post"])
def test_the_lean_step_is_the_plain_forward(block: str) -> None:
    """The lean decode step (`fast_decode`, Python) over rows of one length and of several: hidden states equal to
    the plain cached forward's, to the bit, and the same shifted vectors kept."""
    model = shifted_model(1, block=block)
    assert lean_step_exact(model)
    for lengths in ([5], [7, 2, 12]):
        want, plain = _four_steps(model, lambda c, idx: model.hidden_states(idx, kv_cache=c), lengths)
        got, lean = _four_steps(model, lambda c, idx: decode_hidden(model, idx, c, native=False), lengths)
        assert torch.equal(want, got), lengths
        assert torch.equal(plain.shifted, lean.shifted), lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", ["pre", "parallel", "sandwich", "post"])
def test_the_cpp_step_is_the_lean_one(on_kernel, block: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The C++ step (`native_decode`) over the same packed weights: rows of one length and of several, the hidden
    states and the shifted vectors it keeps within its rounding of the lean step's."""
    model = shifted_model(2, block=block).to(dtype)
    stored = native_decode.cache_dtype(model)
    with PackedLinears(model).active():
        assert native_decode.weights(model, KVCache(model.config, 1, 8, dtype=stored)) is not None  # it runs
        for lengths in ([5], [7, 0, 12]):  # (one row empty: its first token at position 0)
            want, lean = _four_steps(model, lambda c, idx: decode_hidden(model, idx, c, native=False), lengths,
                                     stored, torch.float32)
            got, cpp = _four_steps(model, lambda c, idx: decode_hidden(model, idx, c), lengths, stored, torch.float32)
            assert within_step_rounding(want, got, dtype), lengths
            assert within_step_rounding(lean.shifted, cpp.shifted, dtype), lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_step_prefills_prompt_parts_beside_decoding_rows(on_kernel, dtype: torch.dtype) -> None:  # noqa: ANN001
    """`decode_rows`: a prompt's tokens are rows of one call at successive positions, each mixed with the one
    before it in the same call; the hidden states are those of one forward over each row's whole sequence, and
    every position's shifted vectors are kept."""
    model = shifted_model(3).to(dtype)
    held, fed = {3: 9, 0: 4, 2: 0}, {3: 1, 0: 6, 2: 11}  # cache row -> tokens it holds; then the tokens it is fed
    seqs = {r: tokens(10 + r, (held[r] + fed[r],)).tolist() for r in held}
    cache, hidden = decode_rows_beside(model, held, fed, seqs)
    with torch.inference_mode(), PackedLinears(model).active():
        start = 0
        for r in fed:
            alone = KVCache(model.config, 1, 24, dtype=cache.k.dtype, attend_dtype=torch.float32)
            whole = model.hidden_states(torch.tensor([seqs[r]]), kv_cache=alone)
            assert within_step_rounding(whole[0, held[r]:], hidden[start : start + fed[r]], dtype), r
            n = held[r] + fed[r]
            assert within_step_rounding(alone.shifted[:, 0, :n], cache.shifted[:, r, :n], dtype), r
            start += fed[r]


def greedy_by_whole_forwards(model: GPT, prompt: list[int], n: int) -> list[int]:
    context = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            context.append(int(model(torch.tensor([context])).logits[0, -1].argmax()))
    return context[len(prompt) :]


@pytest.mark.parametrize("kernel", ["torch", None])
@pytest.mark.parametrize("prefill_chunk", [None, 2])
def test_the_engine_decodes_as_whole_forwards(prefill_chunk: int | None, kernel: str | None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of different lengths in one batch, whole or chunked prefill, past the context (the row slides): on
    the lean step (Linears on PyTorch's paths) and on the step the dispatch picks (the C++ one where gptlab's
    kernels build)."""
    if kernel is not None:
        monkeypatch.setenv("GPTLAB_KERNEL", kernel)
    engine = Engine(MODEL, max_batch=2, prefill_chunk=prefill_chunk)
    assert engine.kernels()["decode step"] in (["lean"] if kernel else ["lean", "native C++"])
    assert lean_step_exact(MODEL)
    prompts = [tokens(3, (3,)).tolist(), tokens(4, (11,)).tolist()]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    for prompt, gen in zip(prompts, engine.run([engine.prepare(p, params) for p in prompts]), strict=True):
        assert gen.token_ids == greedy_by_whole_forwards(MODEL, prompt, 20)
        assert len(set(gen.token_ids)) > 1


def test_a_restored_prefix_brings_its_shifted_vectors() -> None:
    """(An engine each: the second's cache rows hold nothing but what the prefix cache restores.)"""
    prefixes = PrefixCache(2**24, block_tokens=4)
    shared = tokens(5, (13,)).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=6)
    for tail in ([1, 2], [3, 4, 5]):
        engine = Engine(MODEL, prefix_cache=prefixes)
        (gen,) = engine.run([engine.prepare(shared + tail, params)])
        assert gen.token_ids == greedy_by_whole_forwards(MODEL, shared + tail, 6)
    assert prefixes.stats().hit_tokens == 12  # the second prompt restored 3 blocks of the first


@pytest.mark.parametrize("draft", ["itself", "ngram"])
def test_speculative_decoding_rolls_the_shifted_vectors_back(draft: str) -> None:
    """Rejected guesses leave their vectors past the row's end; the next step writes over them."""
    params = SamplingParams(temperature=0, max_new_tokens=24)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    (plain,) = generate_batch(MODEL, [prompt], params)
    other = shifted_model(seed=1)
    # (prompt lookup after any match: the model's output repeats no 3 tokens)
    engine = Engine(MODEL, 1, max_len=40, speculate=NgramDrafter(1) if draft == "ngram" else other, draft_tokens=3)
    (gen,) = engine.run([engine.prepare(prompt, params)])
    assert gen.token_ids == plain.token_ids == greedy_by_whole_forwards(MODEL, prompt, 24)
    assert engine.speculator.stats.proposed > engine.speculator.stats.accepted  # some guesses were rejected


def test_the_cache_counts_the_shifted_vectors() -> None:
    cfg = MODEL.config
    assert cache_bytes(cfg, 3, 10, torch.float32) == 4 * (2 * 2 * 3 * 10 * 64 + 3 * 3 * 10 * 64)
    cache = KVCache(cfg, 3, 10)
    assert cache.k.nbytes + cache.v.nbytes + cache.shifted.nbytes == cache_bytes(cfg, 3, 10, torch.float32)
    with pytest.raises(ValueError, match="without token_shift"):
        KVCache(cfg.replace(token_shift=False), 1, 4).previous(0, torch.zeros(1, 1, 64))


def test_exports_refuse_it_by_name() -> None:
    cfg = GPTConfig.preset("tiny", token_shift=True)
    with pytest.raises(GptlabError, match="token_shift=True"):
        export_family(cfg)
    with pytest.raises(GptlabError, match="token_shift"):
        gguf_architecture(cfg)
    assert "token shift" in cfg.describe()
