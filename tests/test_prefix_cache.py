"""The prefix cache (gptlab.generation.prefix_cache) against the engine without it: the same greedy tokens and the
same logprobs (within fp32 rounding: a restored key was summed in another batch shape) for every model family, on
the plain, lean and C++ decode steps, with rows of a continuous batch reusing prefixes of their own; blocks kept
within the budget, least recently used dropped first, reuse refused where it would not be exact."""

from __future__ import annotations

import pytest
import torch
from families import ALL_FAMILIES, VOCAB
from families import build as family_model
from families import model_of as new_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gptlab.generation.engine as engine_module
from gptlab.config import RopeScaling
from gptlab.generation import Engine, Generation, PrefixCache, SamplingParams
from gptlab.hooks import hooked
from gptlab.kv_cache import KVCache
from gptlab.steering import SteeringVector, steered

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, logprobs=2)
PREFIX = [int(t) for t in torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(1))]
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    """One model per family for the module (tests that change a model build their own)."""
    if family not in _MODELS:
        _MODELS[family] = new_model(family)
    return _MODELS[family]


def big_cache(block_tokens: int = 4) -> PrefixCache:
    return PrefixCache(2**26, block_tokens)


def alone(model: torch.nn.Module, prompt: list[int], params: SamplingParams = GREEDY) -> Generation:
    """The reference: the prompt on an engine of its own, no prefix cache."""
    engine = Engine(model)
    return engine.run([engine.prepare(prompt, params)])[0]


def assert_same(got: Generation, want: Generation) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert torch.allclose(torch.tensor([e.logprob for e in got.logprobs]),
                          torch.tensor([e.logprob for e in want.logprobs]), atol=1e-4)


@pytest.fixture(params=["plain", "lean"])
def step(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine's decode step: the model's own forward, or the lean step on PyTorch's Linears."""
    monkeypatch.setenv("GPTLAB_KERNEL", "torch")
    if request.param == "plain":
        monkeypatch.setattr(engine_module, "lean_step_exact", lambda m: False)
    return request.param


def _requests_sharing_a_prefix(model: torch.nn.Module, step_name: str) -> None:
    """(A model of its own: a model's packed weights, made for one kernel, are kept with it.)"""
    cache = big_cache()
    engine = Engine(model, prefix_cache=cache)
    assert engine.kernels()["decode step"] == step_name
    prompts = [PREFIX + [1, 2, 3, 4, 5], PREFIX + [6, 7, 8, 9, 10, 11, 12], PREFIX + [1, 2, 3, 4, 5]]
    hits = []
    for prompt in prompts:
        before = cache.stats().hit_tokens
        assert_same(engine.run([engine.prepare(prompt, GREEDY)])[0], alone(model, prompt))
        hits.append(cache.stats().hit_tokens - before)
    # the second request finds the prefix's 5 whole blocks; the third, the first one's prompt and reply as far as
    # its own prompt goes (all but its last token, whose logits it needs: 6 blocks of its 26 tokens)
    assert hits == [0, 20, 24]


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_requests_sharing_a_prefix_decode_as_without_the_cache(family: str, step: str) -> None:
    """Past sliding windows too (prefixes of 21 tokens, windows of 5 and 7), with RoPE of every layout and scaling
    that does not depend on the length, and learned positions."""
    _requests_sharing_a_prefix(new_model(family), step)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_requests_sharing_a_prefix_on_the_native_step(on_kernel, family: str) -> None:  # noqa: ANN001
    _requests_sharing_a_prefix(new_model(family), "native C++")


@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_rows_of_a_continuous_batch_reuse_prefixes_independently(prefill_chunk: int | None) -> None:
    """Rows joining a running batch each restore their own prefix (the first row's prompt, another's, none) and
    decode as they would alone, chunked prefill or not."""
    model = model_of("llama")
    cache = big_cache()
    engine = Engine(model, max_batch=5, prefix_cache=cache, prefill_chunk=prefill_chunk)
    other = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    engine.add([first := engine.prepare(PREFIX + [1, 2], GREEDY)])
    engine.add([second := engine.prepare(other + [3], GREEDY)])  # another prefix, kept once its prompt is in
    while not (first.token_ids and second.token_ids):
        engine.step()
    joining = [engine.prepare(p, GREEDY) for p in (PREFIX + [4, 5, 6], other + [7, 8], [40, 41, 42, 43, 44, 45])]
    engine.add(joining)
    while engine.running:
        engine.step()
    for gen in [first, second, *joining]:
        assert_same(gen, alone(model, gen.prompt_ids))
    assert cache.stats().hit_tokens == 20 + 8  # the first prompt's 5 blocks, the other's 2; the last row none


def test_rows_that_fit_alone_but_not_padded_together_are_prefilled_one_by_one() -> None:
    """A row restoring a long prefix and a row with a long prompt of its own, prefilled together, would need
    (longest restored) + (longest rest) positions: more than the cache holds, so each row goes on its own."""
    model = model_of("llama")
    cache = big_cache()
    engine = Engine(model, max_batch=2, max_len=40, prefix_cache=cache)
    params = SamplingParams(temperature=0, max_new_tokens=4, logprobs=2)
    long_prefix = PREFIX + PREFIX[:11]  # 32 tokens
    engine.run([engine.prepare(long_prefix + [1], params)])
    gens = [engine.prepare(long_prefix + [2, 3], params), engine.prepare([50] * 30, params)]  # 32 + 2, 0 + 30
    engine.run(gens)
    for gen in gens:
        assert_same(gen, alone(model, gen.prompt_ids, params))
    assert cache.stats().hit_tokens == 32


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(["llama", "mistral", "gpt2"]),
       prefix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
       suffixes=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=8), min_size=1, max_size=3),
       block_tokens=st.integers(1, 6), together=st.booleans())
def test_any_shared_prefix_decodes_as_without_the_cache(family: str, prefix: list[int], suffixes: list[list[int]],
                                                        block_tokens: int, together: bool) -> None:
    """Random prompts sharing a random prefix, after a first request with that prefix, admitted together (one
    padded prefill, each row after its own restored prefix) or one by one: each decodes as it does alone."""
    model = model_of(family)
    params = SamplingParams(temperature=0, max_new_tokens=5, logprobs=2)
    engine = Engine(model, max_batch=3, prefix_cache=PrefixCache(2**24, block_tokens))
    engine.run([engine.prepare(prefix + [0], params)])
    gens = [engine.prepare(prefix + s, params) for s in suffixes]
    for batch in [gens] if together else [[g] for g in gens]:
        engine.run(batch)
    for gen in gens:
        assert_same(gen, alone(model, gen.prompt_ids, params))


# ---------------------------------------------------------------------------------------------------------------
# The blocks: what is kept, within the budget, least recently used dropped first
# ---------------------------------------------------------------------------------------------------------------
def _fill(kv: KVCache, row: int, tokens: list[int]) -> None:
    """Stand-in keys and values of a row holding `tokens`: each position's a function of the tokens up to it, as a
    model's are."""
    for p in range(len(tokens)):
        kv.k[:, row, :, p] = float(hash(tuple(tokens[: p + 1])) % 10_007)
        kv.v[:, row, :, p] = -float(hash(tuple(tokens[: p + 1])) % 10_007)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=12)), max_size=25),
       capacity=st.integers(1, 6))
def test_kept_blocks_restore_what_was_stored_within_the_budget(ops: list[tuple[bool, list[int]]],
                                                               capacity: int) -> None:
    """Any sequence of stores and lookups over a 3-token alphabet, 2 tokens a block: a lookup restores only
    keys and values stored for exactly those tokens at those positions, the bytes kept stay within the budget,
    and every kept block's prefix is kept too (a leaf is always evicted first)."""
    model = model_of("llama")
    kv = KVCache(model.config, 2, 16)
    block_bytes = 2 * kv.k[:, 0, :, :2].numel() * kv.k.element_size()
    cache = PrefixCache(capacity * block_bytes, block_tokens=2)
    for store, tokens in ops:
        if store:
            _fill(kv, 0, tokens)
            cache.store(model, kv, 0, tokens)
        else:
            kv.k[:, 1].zero_()
            n = cache.restore(model, kv, 1, tokens)
            assert n % 2 == 0 and n < len(tokens)
            _fill(kv, 0, tokens)
            assert torch.equal(kv.k[:, 1, :, :n], kv.k[:, 0, :, :n])
            assert torch.equal(kv.v[:, 1, :, :n], kv.v[:, 0, :, :n])
        stats = cache.stats()
        assert stats.bytes == sum(b.k.nbytes + b.v.nbytes for b in cache._blocks.values()) <= stats.budget_bytes
        ids = {b.id for b in cache._blocks.values()}
        assert all(b.key[0] in ids or b.key[0] == 0 for b in cache._blocks.values())


def test_the_least_recently_used_blocks_go_first() -> None:
    model = model_of("llama")
    kv = KVCache(model.config, 1, 16)
    block_bytes = 2 * kv.k[:, 0, :, :2].numel() * kv.k.element_size()
    cache = PrefixCache(3 * block_bytes, block_tokens=2)
    x, y = [1, 1, 1, 1, 9], [2, 2, 2, 2, 9]
    cache.store(model, kv, 0, x)
    cache.store(model, kv, 0, y)  # 4 blocks for 3: x's second block, the least recently used leaf, goes
    assert (cache.restore(model, kv, 0, x), cache.restore(model, kv, 0, y)) == (2, 4)
    cache.store(model, kv, 0, [3, 3, 9])  # x's first block, now the least recently used
    assert (cache.restore(model, kv, 0, x), cache.restore(model, kv, 0, y)) == (0, 4)
    stats = cache.stats()
    assert (stats.blocks, stats.evicted_blocks, stats.bytes) == (3, 2, 3 * block_bytes)
    assert stats.hit_rate == pytest.approx(10 / 20)


def test_budgets_and_the_off_switch() -> None:
    assert PrefixCache.of_megabytes(0) is None
    assert PrefixCache.of_megabytes(1.5).budget_bytes == 3 * 2**19
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            PrefixCache.of_megabytes(bad)
    model = model_of("llama")
    kv = KVCache(model.config, 1, 16)
    tiny = PrefixCache(100, block_tokens=4)  # less than one block: nothing is kept
    tiny.store(model, kv, 0, list(range(12)))
    assert tiny.stats().blocks == 0 and tiny.restore(model, kv, 0, list(range(12))) == 0


# ---------------------------------------------------------------------------------------------------------------
# Where reuse would not be exact, it is refused
# ---------------------------------------------------------------------------------------------------------------
def test_length_dependent_rope_reuses_only_within_the_pretraining_context() -> None:
    """Dynamic NTK scaling turns its frequencies with the forward's last position once it passes the pretraining
    context: keys kept from a shorter forward would be rotated otherwise than a whole prefill rotates them."""
    model = family_model("llama", rope_scaling=RopeScaling("dynamic", factor=2.0, original_context=16))
    cache = big_cache()
    engine = Engine(model, prefix_cache=cache)
    short, long = PREFIX[:10], PREFIX + PREFIX[:9]  # 10 + 1 and 30 + 1 tokens: within and past 16
    for prompt in (short, long):
        engine.run([engine.prepare(prompt + [0], GREEDY)])
        before = cache.stats().hit_tokens
        assert_same(engine.run([engine.prepare(prompt + [1], GREEDY)])[0], alone(model, prompt + [1]))
        assert cache.stats().hit_tokens - before == (8 if prompt is short else 0)


def test_a_steered_or_hooked_model_neither_reuses_nor_leaves_blocks() -> None:
    """A whole model `steered` (hook points set) computes other keys than the plain model: a prompt run under it
    reuses none of the plain run's blocks, and a plain run afterwards none of its own."""
    model = family_model("llama")
    vector = SteeringVector(torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(0)) * 3, 1)
    cache = big_cache()
    engine = Engine(model, prefix_cache=cache)
    engine.run([engine.prepare(PREFIX + [0], GREEDY)])
    with steered(model, [vector]):
        got = engine.run([engine.prepare(PREFIX + [1], GREEDY)])[0]
        want = alone(model, PREFIX + [1])
        with hooked(model, {"blocks.0.hook_resid_post": lambda x: x}):
            engine.run([engine.prepare(PREFIX + [2], GREEDY)])
    assert_same(got, want)
    assert cache.stats().hit_tokens == 0
    assert_same(engine.run([engine.prepare(PREFIX + [1], GREEDY)])[0], alone(model, PREFIX + [1]))
    assert cache.stats().hit_tokens == 20  # the first, plain run's blocks


def test_changed_weights_drop_every_block() -> None:
    model = family_model("llama")
    cache = big_cache()
    engine = Engine(model, prefix_cache=cache)
    engine.run([engine.prepare(PREFIX + [0], GREEDY)])
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(1.5)  # in place: the version counter moves
    gen = engine.run([engine.prepare(PREFIX + [1], GREEDY)])[0]
    assert cache.stats().hit_tokens == 0
    assert_same(gen, alone(model, PREFIX + [1]))


def test_training_mode_and_prompt_logprobs_are_not_served_from_the_cache() -> None:
    """Dropout makes keys random in training mode; prompt logprobs need every prompt position's hidden state."""
    model = model_of("llama")
    cache = big_cache()
    kv = KVCache(model.config, 1, 32)
    cache.store(model, kv, 0, PREFIX)
    model.train()
    try:
        assert cache.restore(model, kv, 0, PREFIX) == 0
    finally:
        model.eval()
    engine = Engine(model, prefix_cache=cache)
    engine.run([engine.prepare(PREFIX, GREEDY)])
    scored = SamplingParams(temperature=0, max_new_tokens=3, prompt_logprobs=True, logprobs=1)
    before = cache.stats().hit_tokens
    got = engine.run([engine.prepare(PREFIX + [3], scored)])[0]
    want = alone(model, PREFIX + [3], scored)
    assert cache.stats().hit_tokens == before
    assert [e and round(e.logprob, 4) for e in got.prompt_logprobs] == [e and round(e.logprob, 4)
                                                                         for e in want.prompt_logprobs]
