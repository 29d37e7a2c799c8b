"""The generation engine: every claim checked against full forwards or hand-computed values, on tiny
models."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from helpers import REPO, ByteTokenizer, chain, scripted_model, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import gptlab
from gptlab.generation import (
    Engine,
    InvalidSamplingParam,
    PromptTooLongError,
    SamplingParams,
    TextState,
    generate,
    generate_batch,
    generate_stream,
    sample_next,
)
from gptlab.generation.logit_filters import apply_min_p, apply_penalties, apply_top_k, apply_top_p
from gptlab.generation.sampling import inverse_cdf
from gptlab.linear import plain_linear
from gptlab.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_new_tokens=50)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, slide: int | None = None) -> list[int]:
    """Step-by-step argmax of full forwards (no cache). With `slide`, a context that would pass block_size
    keeps its last `slide` tokens, as the engine's RoPE sliding window does."""
    context, out = list(prompt), []
    for _ in range(n):
        logits, _ = model(torch.tensor([context]))
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        context.append(tok)
        if slide and len(context) > model.config.block_size:
            context = context[-slide:]
    return out


# ---------------------------------------------------------------------------------------------------------
# Correctness against full forwards
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_greedy_with_cache_equals_full_forward_argmax(position):
    model = tiny_model(position)
    prompt = [3, 14, 15, 92, 65]
    (gen,) = generate_batch(model, [prompt], GREEDY)
    assert gen.token_ids == reference_greedy(model, prompt, 50)
    assert gen.finish_reason == "length"
    assert len(set(gen.token_ids)) > 3  # a non-degenerate continuation, so the comparison means something


def test_model_generate_matches_nanogpt_shape_and_greedy():
    model = tiny_model()
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = gptlab.generate(model, idx, 20, temperature=0)  # the root package's export is this one
    assert out.shape == (2, 23) and torch.equal(out[:, :3], idx)
    for b in range(2):
        assert out[b, 3:].tolist() == reference_greedy(model, idx[b].tolist(), 20)


def test_generate_turns_dropout_off_and_restores_the_mode():
    model = tiny_model(dropout=0.5).train()
    idx = torch.tensor([[1, 2, 3]])
    first = generate(model, idx, 10, temperature=0)
    assert model.training and torch.equal(first, generate(model, idx, 10, temperature=0))
    assert first[0, 3:].tolist() == reference_greedy(model.eval(), [1, 2, 3], 10)


def test_mixed_length_batch_equals_each_prompt_alone():
    model = tiny_model()
    prompts = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41, 42, 43], [9, 9]]
    batched = generate_batch(model, prompts, SamplingParams(temperature=0, max_new_tokens=30))
    for p, g in zip(prompts, batched, strict=True):
        (alone,) = generate_batch(model, [p], SamplingParams(temperature=0, max_new_tokens=30))
        assert g.token_ids == alone.token_ids


def test_rows_join_and_leave_between_steps():
    """Continuous batching at the engine level: a row added mid-run answers as it would alone."""
    model = tiny_model()
    engine = Engine(model, max_batch=3)
    short = engine.prepare([5, 6], SamplingParams(temperature=0, max_new_tokens=4))
    long = engine.prepare([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=25))
    engine.add([short, long])
    for _ in range(6):
        engine.step()
    assert short.finished and engine.slots[0] is None  # short freed its row
    late = engine.prepare([8, 9, 10, 11], SamplingParams(temperature=0, max_new_tokens=20))
    engine.add([late])
    assert late.row.slot == 0
    while engine.running:
        engine.step()
    assert long.token_ids == reference_greedy(model, [1, 2, 3], 25)
    assert late.token_ids == reference_greedy(model, [8, 9, 10, 11], 20)
    assert short.token_ids == reference_greedy(model, [5, 6], 4)


def test_a_kv_cache_that_leaves_too_little_memory_is_refused_before_it_is_allocated(monkeypatch):
    """The cache may take at most 90% of the free memory (the engine's other buffers need the rest): one that
    would fit only into all of it is refused in one line naming what to lower; a shorter row then fits."""
    from gptlab.errors import GptlabError
    from gptlab.generation import engine as engine_module
    from gptlab.kv_cache import cache_bytes

    model = tiny_model(block_size=64)
    need = cache_bytes(model.config, 4, 64, torch.float32)
    monkeypatch.setattr(engine_module, "available_memory", lambda device: int(need / 0.95))
    with pytest.raises(GptlabError, match=r"KV cache in float32 \(64 positions a row\), more than 90% of the "
                       r".* use a smaller batch or fewer positions a row \(max_len"):
        Engine(model, max_batch=4, pack_weights=False)
    assert Engine(model, max_batch=4, max_len=32, pack_weights=False).cache.k.shape[-2] == 32
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        Engine(model, max_batch=4, max_len=-1, pack_weights=False)


def test_bf16_model_runs_and_returns_fp32_sampling():
    model = tiny_model().to(torch.bfloat16)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_new_tokens=10)
    (gen,) = generate_batch(model, [[1, 2, 3]], params)
    assert len(gen.token_ids) == 10


# ---------------------------------------------------------------------------------------------------------
# Packed Linear weights: the same numbers, the model left alone, adapters kept, changed weights noticed
# ---------------------------------------------------------------------------------------------------------
def _greedy_run(model, pack: bool, engine: Engine | None = None) -> tuple[list[list[int]], list[float]]:
    """Tokens of two greedy rows, and their logprobs one after the other (a new engine unless one is given)."""
    engine = engine or Engine(model, max_batch=2, pack_weights=pack)
    params = SamplingParams(temperature=0, max_new_tokens=20, logprobs=0)
    gens = engine.run([engine.prepare(p, params) for p in ([1, 2, 3], [4, 5])])
    return [g.token_ids for g in gens], [e.logprob for g in gens for e in g.logprobs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linears_give_the_same_tokens_and_leave_the_model_alone(dtype):
    """Where packing does not work (bf16 on a CPU without AVX512-BW, such as this project's CI machine) the
    engine must fall back to the plain linears, not fail."""
    from gptlab.generation.packed_linear import packing_helps

    model = tiny_model(bias=True).to(dtype)
    helps = packing_helps(torch.device("cpu"), dtype)
    runs = {}
    for pack in (True, False):
        engine = Engine(model, max_batch=2, pack_weights=pack)
        assert (engine._packed is not None) == (pack and helps)
        runs[pack] = _greedy_run(model, pack, engine)
    if dtype == torch.float32:
        assert runs[True][0] == runs[False][0]
    else:  # bf16 products round differently on each path (a packed kernel keeps fp32 sums): near-ties may go
        for tokens, logprobs in runs.values():  # either way, so each run must be greedy within bf16's error
            assert_greedy_within(model, [[1, 2, 3], [4, 5]], tokens, logprobs, tol=0.1)
    assert all("forward" not in m.__dict__ for m in model.modules())  # the plain Linear.forward is back


def assert_greedy_within(model, prompts: list[list[int]], tokens: list[list[int]], logprobs: list[float],
                         tol: float) -> None:
    """Each generated token's logprob (as the run reported it) is the full forward's over the same context within
    `tol`, and no other token's is higher by more than `tol`: greedy, up to near-ties of that size."""
    given = iter(logprobs)
    for prompt, out in zip(prompts, tokens, strict=True):
        with torch.no_grad():
            logits, _ = model(torch.tensor([prompt + out]))
        ref = torch.log_softmax(logits[0, len(prompt) - 1: -1].float(), dim=-1)  # (T, V): each new token's
        for t, tok in enumerate(out):
            assert next(given) == pytest.approx(float(ref[t, tok]), abs=tol)
            assert float(ref[t].max() - ref[t, tok]) <= tol


class LoRALinear(nn.Linear):
    """A Linear subclass that adds a low-rank update to its own output (how PEFT-style LoRA layers work)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight, self.bias = base.weight, base.bias
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.5)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora_a.T @ self.lora_b.T


class LoRAWrapper(nn.Module):
    """A module that holds the plain Linear and adds a low-rank path around it."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.down.weight, std=0.5)
        nn.init.normal_(self.up.weight, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def test_packing_keeps_both_kinds_of_adapter():
    model = tiny_model(bias=True)
    base = _greedy_run(model, pack=False)
    torch.manual_seed(1)
    for block in model.transformer.h:
        block.attn.c_attn = LoRALinear(block.attn.c_attn)
        block.mlp.c_fc = LoRAWrapper(block.mlp.c_fc)
    packed = Engine(model, max_batch=2, pack_weights=True)._packed
    if packed is None:
        pytest.skip("packing does not help on this machine")
    assert not any(isinstance(m, LoRALinear) for m in packed.modules)  # the subclass runs its own forward
    assert all(block.mlp.c_fc.base in packed.modules for block in model.transformer.h)  # the wrapped one is packed
    plain, with_packing = _greedy_run(model, pack=False), _greedy_run(model, pack=True)
    assert with_packing[0] == plain[0] and with_packing[1] == pytest.approx(plain[1], abs=1e-4)
    assert plain[1] != pytest.approx(base[1], abs=1e-2)  # the adapters do change the model's answers


def test_a_weight_changed_after_packing_is_packed_again():
    model = tiny_model(bias=True)
    engine = Engine(model, max_batch=2, pack_weights=True)
    if engine._packed is None:
        pytest.skip("packing does not help on this machine")
    before = _greedy_run(model, pack=True, engine=engine)
    with torch.no_grad():  # in place, as an optimizer step or load_state_dict writes
        for block in model.transformer.h:
            block.mlp.c_fc.weight.mul_(-2.0)
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    assert engine._packed.refresh() == len(model.transformer.h) + 1
    assert engine._packed.refresh() == 0  # packed again once, not on every forward
    with torch.no_grad():  # replaced by a new Parameter, as load_state_dict(assign=True) does
        model.transformer.h[0].attn.c_proj.weight = nn.Parameter(model.transformer.h[0].attn.c_proj.weight * 3)
    after = _greedy_run(model, pack=True, engine=engine)
    assert after[0] == _greedy_run(model, pack=False)[0] != before[0]
    assert after[1] == pytest.approx(_greedy_run(model, pack=False)[1], abs=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Sampling controls on hand-made logits
# ---------------------------------------------------------------------------------------------------------
def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None]


def _kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    assert _kept(apply_top_k(logits, 2)) == [1, 3]
    assert _kept(apply_top_k(logits, 0)) == [0, 1, 2, 3, 4]
    rows = apply_top_k(logits.repeat(2, 1), torch.tensor([1, 3]))
    assert torch.isfinite(rows).sum(-1).tolist() == [1, 3]


def test_top_p_keeps_exactly_the_nucleus():
    # sorted probabilities 0.5, 0.25, 0.15, 0.1 placed out of order
    logits = _logits([0.15, 0.5, 0.1, 0.25])
    assert _kept(apply_top_p(logits, 0.4)) == [1]  # the top token alone already reaches 0.4
    assert _kept(apply_top_p(logits, 0.74)) == [1, 3]  # 0.5 + 0.25 = 0.75 >= 0.74
    assert _kept(apply_top_p(logits, 0.76)) == [0, 1, 3]  # needs 0.15 too: 0.90
    assert _kept(apply_top_p(logits, 0.95)) == [0, 1, 2, 3]
    assert _kept(apply_top_p(logits, 1.0)) == [0, 1, 2, 3]
    per_row = apply_top_p(logits.repeat(2, 1), torch.tensor([0.74, 0.95]))
    assert torch.isfinite(per_row).sum(-1).tolist() == [2, 4]


@settings(max_examples=40, deadline=None)
@given(vocab=st.sampled_from([10, 300, 5000]), peak=st.floats(0.5, 12.0), p=st.floats(0.05, 1.2),
       seed=st.integers(0, 2**31))
def test_top_p_among_the_likely_tokens_keeps_what_sorting_all_keeps(vocab, peak, p, seed):
    """Against the nucleus read off the whole vocabulary sorted: flat rows (whose nucleus lies beyond the first
    candidates, or needs the whole sort) and peaked ones (within the first 256), per-row p's, one row at p >= 1 (no
    ties: which of two equally likely tokens a nucleus takes is arbitrary)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=g) * torch.tensor([[0.1], [peak], [peak / 2]])
    ps = torch.tensor([p, min(p, 0.99), 1.0])
    probs = logits.softmax(-1)
    likely, order = probs.sort(-1, descending=True)
    keep = (likely.cumsum(-1) - likely < ps[:, None]) | (ps[:, None] >= 1)
    keep[:, 0] = True
    expected = torch.zeros_like(keep).scatter_(-1, order, keep)
    assert torch.equal(torch.isfinite(apply_top_p(logits, ps)), expected)


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    logits = _logits([0.15, 0.5, 0.1, 0.25])
    assert _kept(apply_min_p(logits, 0.25)) == [0, 1, 3]  # threshold 0.125
    assert _kept(apply_min_p(logits, 0.6)) == [1]  # threshold 0.3
    assert _kept(apply_min_p(logits, 0.0)) == [0, 1, 2, 3]


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])  # tokens 0, 1 occur in the prompt or output
    counts = torch.tensor([[0.0, 2.0, 0.0, 1.0]])  # output counts (token 3 came from the output only)
    # repetition 2 on seen: 2 / 2 = 1, -1 * 2 = -2; untouched 0.5 and 3.0 (token 3 counts as seen in practice,
    # but this checks that only `seen` is used)
    out = apply_penalties(logits, counts, seen, repetition=2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]
    # OpenAI: logit - count * frequency - (count > 0) * presence
    out = apply_penalties(logits, counts, seen, frequency=0.5, presence=0.25)
    assert out.tolist() == [[2.0, -1.0 - 1.0 - 0.25, 0.5, 3.0 - 0.5 - 0.25]]


def test_penalties_change_what_greedy_picks():
    model = scripted_model({1: 2, 2: 1}, vocab_size=8)  # 1 -> 2 -> 1 -> ...
    (plain,) = generate_batch(model, [[1]], SamplingParams(temperature=0, max_new_tokens=4))
    assert plain.token_ids == [2, 1, 2, 1]
    (pen,) = generate_batch(model, [[1]], SamplingParams(temperature=0, max_new_tokens=4, presence_penalty=3.0))
    assert pen.token_ids[:2] == [2, 1] and pen.token_ids[2] != 2  # 2 was already generated: penalized below 0


def test_top_k_1_equals_greedy():
    model = tiny_model()
    (greedy,) = generate_batch(model, [[4, 5, 6]], SamplingParams(temperature=0, max_new_tokens=30))
    for seed in (0, 1):
        params = SamplingParams(temperature=1.3, top_k=1, seed=seed, max_new_tokens=30)
        (k1,) = generate_batch(model, [[4, 5, 6]], params)
        assert k1.token_ids == greedy.token_ids


def test_sampler_draws_from_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    freq = torch.bincount(torch.tensor(sample_next(logits, params, gens)), minlength=4) / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    params = [SamplingParams(temperature=1.0, top_p=0.7)] * 4000  # nucleus {0.5, 0.3}, renormalized
    freq = torch.bincount(torch.tensor(sample_next(logits, params, gens)), minlength=4) / 4000
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.03
    params = [SamplingParams(temperature=0.5)] * 4000  # p^2 renormalized
    freq = torch.bincount(torch.tensor(sample_next(logits, params, gens)), minlength=4) / 4000
    assert torch.allclose(freq, probs**2 / (probs**2).sum(), atol=0.03)
    # rows on torch's global generator draw their uniforms together, from the same distribution
    torch.manual_seed(0)
    freq = torch.bincount(torch.tensor(sample_next(logits, params, [None] * 4000)), minlength=4) / 4000
    assert torch.allclose(freq, probs**2 / (probs**2).sum(), atol=0.03)
    # a vocabulary of many blocks: the tokens far apart, one at a block's edge, the rest at -inf
    wide = torch.full((4000, 1300), float("-inf"))
    tokens = torch.tensor([255, 256, 700, 1299])
    wide[:, tokens] = probs.log()
    drawn = torch.tensor(sample_next(wide, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000))
    assert torch.isin(drawn, tokens).all()
    assert torch.allclose(torch.stack([(drawn == t).float().mean() for t in tokens]), probs, atol=0.03)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 1200), rows=st.integers(1, 5), zeros=st.floats(0, 0.95), seed=st.integers(0, 2**31),
       edge=st.sampled_from([None, 0.0, 1 - 2**-53]))
def test_inverse_cdf_finds_where_each_uniform_falls(vocab, rows, zeros, seed, edge):
    """Against one fp64 scan over the whole row: the token whose cumulative weight brackets u times the total,
    whatever the vocabulary's width against the blocks; never a token of weight 0, even at u's extremes."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(rows, vocab, generator=g) * (torch.rand(rows, vocab, generator=g) >= zeros)
    weights[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] = 0.5  # some positive weight a row
    u = torch.rand(rows, dtype=torch.float64, generator=g) if edge is None else torch.full((rows,), edge,
                                                                                          dtype=torch.float64)
    got = inverse_cdf(weights, u)
    assert (weights.gather(1, got[:, None]) > 0).all()
    cdf = weights.double().cumsum(-1)
    for i in range(rows):
        j, total = int(got[i]), float(cdf[i, -1])
        target, tol = float(u[i]) * total, 1e-6 * total  # blocks' sums are fp32: an edge may move by ~1e-7
        assert (cdf[i, j - 1] if j else 0.0) <= target + tol and (target < cdf[i, j] + tol or edge)


@pytest.mark.parametrize("vocab", [10, 300, 50257])
def test_inverse_cdf_stays_in_the_vocabulary_when_weights_are_not_finite(vocab):
    """A penalty can overflow a row's logits (repetition_penalty 5e-324: a 500 from the server once): the row's
    token must still be one of the vocabulary's, and an infinite weight wins."""
    weights = torch.rand(3, vocab)
    weights[0, 3], weights[1, 5], weights[2] = float("nan"), float("inf"), float("nan")
    for u in (0.0, 0.5, 1 - 2**-53):
        got = inverse_cdf(weights, torch.full((3,), u, dtype=torch.float64))
        assert ((got >= 0) & (got < vocab)).all() and got[1] == 5


def test_a_seeded_row_draws_the_same_beside_shared_and_greedy_rows():
    """A batch mixing rows on the global generator, seeded rows and greedy rows: each seeded row's tokens are the
    ones it draws alone, a greedy row's is its argmax, and the shared rows still sample."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    hot, cold = SamplingParams(temperature=1.0), SamplingParams(temperature=0)
    params = [hot, hot, cold, hot, cold, hot]
    seeds = [None, 11, None, None, 5, 12]
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    alone = {i: sample_next(logits[i : i + 1], [params[i]], [torch.Generator().manual_seed(seeds[i])])[0]
             for i in (1, 5)}
    draws = [sample_next(logits, params, gens) for _ in range(20)]
    first = draws[0]
    assert first[1] == alone[1] and first[5] == alone[5]
    assert first[2] == logits[2].argmax() and first[4] == logits[4].argmax()
    assert len({d[0] for d in draws}) > 1 and len({d[3] for d in draws}) > 1  # the shared rows are not frozen
    assert torch.equal(gens[4].get_state(), torch.Generator().manual_seed(5).get_state())  # a greedy row's: untouched


def test_same_seed_same_text_and_other_seeds_differ():
    model = tiny_model()
    params = lambda s: SamplingParams(temperature=1.0, seed=s, max_new_tokens=30)  # noqa: E731
    (a,) = generate_batch(model, [[1, 2]], params(7))
    (b,) = generate_batch(model, [[1, 2]], params(7))
    (c,) = generate_batch(model, [[1, 2]], params(8))
    assert a.token_ids == b.token_ids != c.token_ids
    # a seeded row is unaffected by its neighbours in the batch
    batch = generate_batch(model, [[9, 9, 9], [1, 2]], params(7))
    engine = Engine(model, max_batch=2)
    other = engine.prepare([9, 9, 9], SamplingParams(temperature=1.0, seed=123, max_new_tokens=30))
    mine = engine.prepare([1, 2], params(7))
    engine.run([other, mine])
    assert mine.token_ids == a.token_ids
    assert batch[0].token_ids != batch[1].token_ids  # sample i of a request gets its own stream


@pytest.mark.parametrize("bad, field", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed="7"), "seed"),
])
def test_invalid_params_name_their_field(bad, field):
    with pytest.raises(InvalidSamplingParam) as info:
        SamplingParams(**bad)
    assert info.value.field == field and isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{field} must") and ", got " in str(info.value)


def test_each_control_has_one_off_value():
    assert SamplingParams(top_k=None, top_p=None, min_p=None) == SamplingParams()
    off = SamplingParams()
    assert (off.top_k, off.top_p, off.min_p) == (0, 1.0, 0.0)
    # in a batch where other rows filter, a row with every control off samples exactly as it would without them
    logits = torch.randn(60, 50) * 3
    filtering = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2)]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(60)]  # noqa: E731
    mixed = sample_next(logits, [off] * 30 + filtering * 10, gens())
    plain = sample_next(logits, [off] * 60, gens())
    assert mixed[:30] == plain[:30] and mixed[30:] != plain[30:]


def test_params_from_fields_picks_the_named_keys():
    fields = {"temperature": 0.5, "top_p": None, "prompt": "ignored", "n": 3, "stop": "x"}
    params = SamplingParams.from_fields(fields, max_new_tokens=7, stop=["y"])
    assert params == SamplingParams(temperature=0.5, max_new_tokens=7, stop=("y",))
    with pytest.raises(TypeError, match="max_tokens"):  # a misspelt override is an error, not ignored
        SamplingParams.from_fields({}, max_tokens=3)
    with pytest.raises(InvalidSamplingParam, match="top_k"):
        SamplingParams.from_fields({"top_k": -1})


def test_params_module_does_not_import_torch():
    code = "import sys, gptlab.generation.params; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_package_exports_what_it_lists():
    import gptlab.generation as generation

    assert generation.__all__ == list(generation._LAZY)
    assert all(getattr(generation, name) is not None for name in generation.__all__)
    assert generation.generate is gptlab.generate and generation.SamplingParams is gptlab.SamplingParams


# ---------------------------------------------------------------------------------------------------------
# Stops, text and streaming
# ---------------------------------------------------------------------------------------------------------
def _char_setup(script: str):
    tok = CharTokenizer.from_text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!. ")
    model = scripted_model(chain(tok.encode(script)), vocab_size=tok.vocab_size)
    return model, tok


def test_stop_string_spanning_tokens_is_not_returned_or_streamed():
    model, tok = _char_setup("Gbright XYZmunk")
    for stop in (["XYZ"], ["t X", "zzz"], ["ght"]):
        params = SamplingParams(temperature=0, max_new_tokens=40, stop=stop)
        result = []
        deltas = list(generate_stream(model, tok, "G", params, result=result))
        expected = "bright XYZmunk".split(stop[0])[0]
        assert "".join(deltas) == expected == result[0].text
        assert result[0].finish_reason == "stop"
    # the end of a possible stop string is held back and released when it doesn't complete
    params = SamplingParams(temperature=0, max_new_tokens=7, stop=["ht Q"])
    assert "".join(generate_stream(model, tok, "G", params)) == "bright "


def test_stop_token_ends_the_row():
    model, tok = _char_setup("Gabcdef")
    stop_id = tok.encode("d")[0]
    params = SamplingParams(temperature=0, max_new_tokens=9, stop_token_ids=[stop_id])
    (gen,) = generate_batch(model, [tok.encode("G")], params, tokenizer=tok)
    assert gen.finish_reason == "stop" and gen.text == "abc" and gen.token_ids[-1] == stop_id
    out = generate(model, torch.tensor([tok.encode("G")]), 9, temperature=0, stop_token_ids=[stop_id], pad_id=0)
    assert out[0].tolist() == tok.encode("Gabcd")


def test_emoji_split_over_byte_tokens_streams_intact():
    tok = ByteTokenizer()
    text = "A\U0001f600é!"  # 1 + 4 + 2 + 1 bytes, all distinct
    model = scripted_model(chain(tok.encode(text)), vocab_size=256)
    deltas = list(generate_stream(model, tok, "A", SamplingParams(temperature=0, max_new_tokens=7)))
    assert "".join(deltas) == "\U0001f600é!"
    assert all("\ufffd" not in d for d in deltas) and "\U0001f600" in deltas


def test_a_stop_string_the_rows_last_broken_character_completes_ends_it_as_stop():
    tok = ByteTokenizer()
    model = scripted_model(chain(tok.encode("A") + [0xF0, 0x9F]), vocab_size=256)  # half an emoji after "A"
    params = SamplingParams(temperature=0, max_new_tokens=2, stop=["\ufffd"])
    (gen,) = generate_batch(model, [tok.encode("A")], params, tokenizer=tok)
    assert gen.token_ids == [0xF0, 0x9F] and gen.text == "" and gen.finish_reason == "stop"


def test_text_state_unit():
    tok = ByteTokenizer()
    state = TextState(tok, context_ids=tok.encode("x"), stop=["\U0001f600!"])
    out = []
    for b in "ok \U0001f600?\U0001f600!tail".encode():
        if state.push(b):
            break
        out.append(state.pop_delta())
    assert state.stopped and state.text == "ok \U0001f600?"
    assert "".join(out) + state.pop_delta(final=True) == "ok \U0001f600?"
    cut = TextState(tok)
    cut.push(0xF0)  # a truncated character becomes U+FFFD once the row ends
    cut.close()
    assert cut.pop_delta() == "\ufffd"


# ASCII, a two-, three- and four-byte character's bytes, and a byte no UTF-8 text holds: valid and broken sequences
_BYTES = st.lists(st.sampled_from([0x61, 0x21, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF]),
                  max_size=14)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_streamed_text_is_the_whole_decode_cut_at_the_stop_string(data: st.DataObject):
    """Whatever the bytes (half characters, invalid ones), the deltas joined are the decode of all the tokens at
    once, cut before the first stop string (one drawn from that text, U+FFFD included) where it has one."""
    tok = ByteTokenizer()
    ids = data.draw(_BYTES)
    whole = tok.decode(ids)
    start = data.draw(st.integers(0, len(whole)))
    stop = whole[start : data.draw(st.integers(start, len(whole)))]
    state = TextState(tok, stop=[stop] if stop else [])
    out = ""
    for i in ids:
        if state.push(i):
            break
        out += state.pop_delta()
    state.close()
    out += state.pop_delta(final=True)
    assert out == (whole[: whole.find(stop)] if stop else whole)


# ---------------------------------------------------------------------------------------------------------
# Context limits
# ---------------------------------------------------------------------------------------------------------
def test_prompt_too_long_errors_or_truncates():
    model = tiny_model("learned", block_size=16)
    with pytest.raises(PromptTooLongError, match="16"):
        generate_batch(model, [list(range(16))], GREEDY)
    with pytest.raises(ValueError):  # also a ValueError, for callers that catch those
        generate(model, torch.arange(20)[None], 5)
    params = SamplingParams(temperature=0, max_new_tokens=5)
    (gen,) = generate_batch(model, [list(range(20))], params, truncate_prompt=True)
    assert gen.prompt_ids == list(range(9, 20)) and gen.truncated == 9  # keeps 16 - 5 tokens
    assert gen.token_ids == reference_greedy(model, list(range(9, 20)), 5)


def test_learned_positions_finish_with_length_at_block_size():
    model = tiny_model("learned", block_size=16)
    (gen,) = generate_batch(model, [list(range(1, 11))], SamplingParams(temperature=0, max_new_tokens=100))
    assert gen.finish_reason == "length" and len(gen.token_ids) == 6  # 10 + 6 = block_size
    assert gen.token_ids == reference_greedy(model, list(range(1, 11)), 6)


@pytest.mark.parametrize("block_size", [16, 7])
def test_rope_sliding_window_goes_past_block_size(block_size):
    model = tiny_model("rope", block_size=block_size)
    prompt = [5, 1, 4]
    (gen,) = generate_batch(model, [prompt], SamplingParams(temperature=0, max_new_tokens=45))
    assert len(gen.token_ids) == 45 and gen.finish_reason == "length"
    assert gen.token_ids == reference_greedy(model, prompt, 45, slide=block_size // 2)
    assert math.isfinite(sum(gen.token_ids))


# ---------------------------------------------------------------------------------------------------------
# gptlab sample
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory):
    from gptlab.checkpoint import save_model

    tok = CharTokenizer.from_text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,!?\n")
    model = tiny_model(vocab_size=tok.vocab_size)
    root = tmp_path_factory.mktemp("sample")
    return save_model(root / "ckpt", model, tok), save_model(root / "no-tok", model), model, tok


def test_sample_streams_the_greedy_continuation(char_checkpoint, capsys):
    from gptlab.cli import main

    path, _, model, tok = char_checkpoint
    assert main(["sample", str(path), "--prompt", "Hello", "--max-new-tokens", "12", "--temperature", "0",
                 "--num-samples", "2"]) == 0
    (ref,) = generate_batch(model, [tok.encode("Hello")], SamplingParams(temperature=0, max_new_tokens=12),
                      tokenizer=tok)
    sample = "Hello" + ref.text + "\n---------------\n"
    assert capsys.readouterr().out == sample * 2
    args = ["sample", str(path), "--max-new-tokens", "20", "--seed", "3", "--top-p", "0.9"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first and first.startswith("\n")  # default prompt "\n"


def test_sample_lists_each_tokens_logprob_on_stderr(char_checkpoint, capsys):
    """--logprobs N: stdout keeps the text alone; stderr has a line per generated token whose log-probability is
    the plain forward's log-softmax at that position (the model read whole, no cache), and N alternatives, best
    first."""
    from gptlab.cli import main

    path, _, model, tok = char_checkpoint
    assert main(["sample", str(path), "--prompt", "Hello", "--max-new-tokens", "6", "--temperature", "0",
                 "--logprobs", "3"]) == 0
    captured = capsys.readouterr()
    text = captured.out.removesuffix("\n---------------\n")
    header, *lines = captured.err.splitlines()
    assert header == "token\tlogprob\talternatives" and len(lines) == 6
    ids = tok.encode(text)
    with torch.no_grad():
        logits, _ = model.eval()(torch.tensor([ids]))
    expected = torch.log_softmax(logits[0].float(), dim=-1)
    first = len(tok.encode("Hello"))
    for i, line in enumerate(lines):
        token, logprob, alternatives = line.split("\t")
        position = first + i - 1  # the logits that chose token first + i
        assert token == repr(tok.decode([ids[first + i]]))
        assert float(logprob) == pytest.approx(expected[position, ids[first + i]].item(), abs=1e-3)
        shown = alternatives.split(", ")
        assert len(shown) == 3 and shown[0].startswith(token)  # greedy: the token is its own best alternative
    assert main(["sample", str(path), "--logprobs", "21"]) == 2
    assert "--logprobs" in capsys.readouterr().err


def test_logprobs_show_a_token_holding_part_of_a_character_as_its_replacement():
    """A byte-level token alone may be half a UTF-8 character, which a strict `decode` refuses: it shows as U+FFFD,
    as the server shows it."""
    import io

    from gptlab.cli.sample import write_logprobs
    from gptlab.generation import TokenLogprob

    class Strict(ByteTokenizer):
        def decode(self, ids) -> str:  # noqa: ANN001
            return self.decode_bytes(ids).decode("utf-8")

    first, second = "\u00e9".encode()  # one character, two tokens
    out = io.StringIO()
    write_logprobs([TokenLogprob(first, -0.5, ((first, -0.5), (ord("e"), -1.25)))], Strict(), out)
    assert out.getvalue().splitlines()[1] == "'\ufffd'\t-0.5000\t'\ufffd' -0.5000, 'e' -1.2500"


@pytest.mark.parametrize("extra, message", [
    # named as the flag, without prepare's advice (pick another --tokenizer), which sampling cannot take
    (["--prompt", "caf\u00e9"], "error: --prompt has 1 character(s) not in the model's char vocabulary: 'é'\n"),
    (["--prompt", ""], "no end-of-text token"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be an integer in [0, "),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--min-p", "2"], "--min-p must be in [0, 1]"),
    (["--num-samples", "0"], "--num-samples must be at least 1"),
])
def test_sample_errors_are_one_line(char_checkpoint, capsys, extra, message):
    from gptlab.cli import main

    assert main(["sample", str(char_checkpoint[0]), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1


def test_a_prompt_flag_with_bytes_that_are_not_utf8_is_one_line(corpus_bpe, tmp_path, capsys):
    """Python reads an argument's non-UTF-8 bytes as lone surrogates, which a Hugging Face tokenizer cannot take: an
    error naming the flag and the byte (it used to be an internal TypeError)."""
    from gptlab.checkpoint import save_model
    from gptlab.cli import main

    path = save_model(tmp_path / "bpe", tiny_model(vocab_size=corpus_bpe.vocab_size), corpus_bpe)
    argv_bytes = b"ab\xff".decode("utf-8", "surrogateescape")  # as sys.argv holds `--prompt $'ab\xff'`
    assert main(["sample", str(path), "--prompt", argv_bytes, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --prompt is not UTF-8 text: byte 0xff at character 2\n"
    assert main(["attention", str(path), "--prompt", argv_bytes]) == 2
    assert capsys.readouterr().err == "error: --prompt is not UTF-8 text: byte 0xff at character 2\n"


def test_sample_needs_a_checkpoint_with_a_tokenizer(char_checkpoint, tmp_path, capsys):
    from gptlab.cli import main

    assert main(["sample", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["sample", str(char_checkpoint[1])]) == 2
    assert "no tokenizer" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Logprobs: the model's own distribution, checked against log-softmax of plain full forwards
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_log_softmax_of_full_forwards(temperature):
    model = tiny_model()
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=7, logprobs=3, prompt_logprobs=True)
    gens = generate_batch(model, prompts, params)
    for prompt, g in zip(prompts, gens, strict=True):
        seq = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(model(seq)[0][0].float(), dim=-1)  # (T, V): position t scores token t + 1
        assert len(g.logprobs) == len(g.token_ids) == 12
        for j, entry in enumerate(g.logprobs):
            t = len(prompt) - 1 + j
            assert entry.token_id == g.token_ids[j]
            assert entry.logprob == pytest.approx(float(ref[t, entry.token_id]), abs=1e-4)
            top_ids = [tid for tid, _ in entry.top]
            assert top_ids == ref[t].topk(3).indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(ref[t].topk(3).values.tolist(), abs=1e-4)
            if temperature == 0:  # greedy picks the most likely token
                assert entry.token_id == top_ids[0]
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(prompt)
        for t, entry in enumerate(g.prompt_logprobs[1:]):
            assert entry.token_id == prompt[t + 1]
            assert entry.logprob == pytest.approx(float(ref[t, prompt[t + 1]]), abs=1e-4)


def test_a_prompt_is_scored_with_no_new_tokens():
    # max_new_tokens 0 with prompt_logprobs: the prompt scored and nothing generated (OpenAI's echo + max_tokens 0)
    model, prompt = tiny_model(), [3, 1, 4, 1, 5, 9, 2, 6]
    (ref,) = generate_batch(model, [prompt], SamplingParams(max_new_tokens=6, temperature=0, logprobs=2,
                                                            prompt_logprobs=True))
    scored = SamplingParams(max_new_tokens=0, logprobs=2, prompt_logprobs=True)
    expected = [e.logprob for e in ref.prompt_logprobs[1:]]
    (g,) = generate_batch(model, [prompt], scored)
    assert g.token_ids == [] and g.finish_reason == "length"
    assert g.prompt_logprobs[0] is None and [e.logprob for e in g.prompt_logprobs[1:]] == pytest.approx(expected)
    # in chunks, joining rows that decode
    engine = Engine(model, max_batch=2, prefill_chunk=3)
    other = engine.prepare([7, 7], SamplingParams(max_new_tokens=10, temperature=0))
    engine.add([other])
    engine.step()
    g = engine.prepare(prompt, scored)
    engine.add([g])
    while engine.running:
        engine.step()
    assert g.token_ids == [] and g.finish_reason == "length" and len(other.token_ids) == 10
    assert [e.logprob for e in g.prompt_logprobs[1:]] == pytest.approx(expected, abs=1e-5)


def test_logprobs_are_off_by_default_and_bounded():
    (g,) = generate_batch(tiny_model(), [[1, 2]], SamplingParams(max_new_tokens=3, temperature=0))
    assert g.logprobs == [] and g.prompt_logprobs == []
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    mixed = generate_batch(tiny_model(), [[1, 2], [1, 2]], SamplingParams(max_new_tokens=3, temperature=0, logprobs=0))
    assert all(len(g.logprobs) == 3 and all(e.top == () for e in g.logprobs) for g in mixed)


# ---------------------------------------------------------------------------------------------------------
# Chunked prefill: the same tokens and logprobs, with other rows decoding in between
# ---------------------------------------------------------------------------------------------------------
_CHUNK_MODEL = tiny_model(seed=3)


@settings(max_examples=15, deadline=None)
@given(chunk=st.integers(1, 9), lengths=st.lists(st.integers(1, 30), min_size=1, max_size=3))
def test_chunked_prefill_equals_whole_prefill(chunk, lengths):
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate(lengths)]
    params = SamplingParams(max_new_tokens=6, temperature=0, logprobs=1, prompt_logprobs=True)
    whole = generate_batch(_CHUNK_MODEL, prompts, params)
    engine = Engine(_CHUNK_MODEL, max_batch=len(prompts), prefill_chunk=chunk)
    chunked = engine.run([engine.prepare(p, params) for p in prompts])
    for a, b in zip(whole, chunked, strict=True):
        assert a.token_ids == b.token_ids and b.row.pending == []
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-5)
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(a.prompt_ids)
        assert [e.logprob for e in a.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in b.prompt_logprobs[1:]], abs=1e-5)


def test_a_long_prompt_is_prefilled_while_other_rows_decode():
    params = SamplingParams(max_new_tokens=20, temperature=0)
    engine = Engine(_CHUNK_MODEL, max_batch=2, prefill_chunk=4)
    short = engine.prepare([1, 2], params)
    engine.add([short])
    engine.step()
    long = engine.prepare(list(range(3, 23)), params)  # 20 tokens: 5 chunks
    engine.add([long])  # the first chunk now, or (on the C++ decode step) with the next step's tokens
    chunks = -(-len(long.row.pending) // 4)  # the chunks left: one a step
    assert chunks in (4, 5)
    before, steps = len(short.token_ids), 0
    while not long.token_ids:
        advanced = engine.step()
        steps += 1
        assert short in advanced
    assert steps == chunks and len(short.token_ids) == before + chunks  # the short row kept decoding meanwhile
    while engine.running:
        engine.step()
    later = [list(range(40, 50)), list(range(60, 75))]
    alone = generate_batch(_CHUNK_MODEL, [[1, 2], list(range(3, 23)), *later], params)
    assert [short.token_ids, long.token_ids] == [g.token_ids for g in alone[:2]]
    again = engine.run([engine.prepare(p, params) for p in later])  # used rows start from scratch
    assert [g.token_ids for g in again] == [g.token_ids for g in alone[2:]]


# ---------------------------------------------------------------------------------------------------------
# Start-up and per-call costs
# ---------------------------------------------------------------------------------------------------------
def test_generate_packs_a_model_once_and_again_only_what_changed(monkeypatch):
    """Each `generate` call builds an engine; the packed weights are the model's, made by the first call. An
    in-place write is noticed: the next call packs that weight again instead of decoding with the stale copy."""
    from gptlab.generation import engine, packed_linear

    model = tiny_model(bias=True)  # fp32 on a CPU: packing always helps
    packed = []
    pack = packed_linear._pack
    monkeypatch.setattr(packed_linear, "_pack",
                        lambda module, hint, path=None: packed.append(module) or pack(module, hint, path))
    monkeypatch.setattr(engine, "decode_path", lambda *args: None)  # its timing packs copies of its own
    prompt, n = [1, 2, 3], 20
    first = generate(model, torch.tensor([prompt]), n, temperature=0)[0, 3:].tolist()
    linears = [m for m in model.modules() if plain_linear(m)]
    assert len(packed) == len(linears)
    assert generate(model, torch.tensor([prompt]), n, temperature=0)[0, 3:].tolist() == first
    assert len(packed) == len(linears)  # the second call packed nothing
    changed = [block.mlp.c_fc for block in model.transformer.h]
    with torch.no_grad():
        for linear in changed:
            linear.weight.add_(1)
    after = generate(model, torch.tensor([prompt]), n, temperature=0)[0, 3:].tolist()
    assert packed[len(linears):] == changed  # packed again: the changed weights only
    assert after == reference_greedy(model, prompt, n) != first  # the new weights' tokens, not the stale ones
    packed_linear.forget_packed(model)  # e.g. after writes through `.data`, which no version counter sees
    generate(model, torch.tensor([prompt]), n, temperature=0)
    assert len(packed) == 2 * len(linears) + len(changed)


def test_loading_and_sampling_do_not_import_torch_dynamo(char_checkpoint):
    """Building the model on the meta device must not run init (normal_'s meta kernel imports torch._dynamo,
    over a second of `gptlab sample` start-up)."""
    code = ("import sys, torch; from gptlab import generate, load_model; "
            f"model, _ = load_model({str(char_checkpoint[0])!r}); generate(model, torch.tensor([[1]]), 20); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
