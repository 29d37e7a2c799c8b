"""gptlab's C++ sampler (`kernels/sampling.cpp`, `sample_rows`) on every build this machine can execute, against the
maths in float64: the token whose running weight brackets u times the row's total, the weights exp((x - max) / T)
of the tokens a bitmask allows. And `sample_next` with and without it: the same tokens from the same uniforms.

Tolerance: the kernel's exponentials are within ~1e-7 of exp's and its block sums are fp32, so a uniform may land
on the token beside the reference's only within ~1e-5 of the total of an edge."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import packed_mask
from hypothesis import given, settings
from hypothesis import strategies as st

import gptlab.generation.sampling as sampling
from gptlab.generation import SamplingParams
from gptlab.generation.sampling import sample_next
from gptlab.kernels import kernel_builds

NO_MASK = torch.empty(0, dtype=torch.int32)


@pytest.fixture(scope="module")
def ops(build_name: str):  # noqa: ANN201
    """Each build this machine runs (conftest's `build_name`: a skip where one is not there)."""
    return kernel_builds()[build_name]


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """(n, V) bool -> the kernel's (n, ceil(V / 32)) int32 bits."""
    return torch.from_numpy(packed_mask(allowed).view(np.int32))


@settings(max_examples=60, deadline=None)
@given(vocab=st.one_of(st.integers(1, 1300), st.just(50257)), rows=st.integers(1, 4), density=st.floats(0.01, 1.0),
       masked=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 2**31),
       edge=st.sampled_from([None, None, 0.0, 1 - 2**-53]))
def test_kernel_draws_where_each_uniform_falls(ops, vocab, rows, density, masked, bf16, seed, edge) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(torch.bfloat16 if bf16 else torch.float32)
    allowed = torch.rand(rows, vocab, generator=g) < density if masked else torch.ones(rows, vocab, dtype=torch.bool)
    allowed[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] = True  # a token a row at least
    scale = 1 / (torch.rand(rows, generator=g) * 1.5 + 0.2)  # temperatures 0.2-1.7
    u = (torch.rand(rows, dtype=torch.float64, generator=g) if edge is None
         else torch.full((rows,), edge, dtype=torch.float64))
    # rows read through `rows`: a permutation, so the kernel must not assume row i is logits' row i
    order = torch.randperm(rows, generator=g)
    got = ops.sample_rows(x, order, scale, u, pack(allowed[order]) if masked else NO_MASK)
    for i, r in enumerate(order.tolist()):
        xr = x[r].double()
        top = xr[allowed[r]].max()
        w = torch.where(allowed[r], ((xr - top) * float(scale[i])).exp(), 0.0)
        cdf = w.cumsum(0)
        j, total = int(got[i]), float(cdf[-1])
        assert 0 <= j < vocab and allowed[r, j] and w[j] > 0
        target, tol = float(u[i]) * total, 1e-5 * total
        assert (cdf[j - 1] if j else 0.0) <= target + tol and (target < cdf[j] + tol or edge)


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(1, 700), rows=st.integers(1, 4), masked=st.booleans(), seed=st.integers(0, 2**31))
def test_kernel_greedy_rows_take_the_first_allowed_argmax(ops, vocab, rows, masked, seed) -> None:  # noqa: ANN001
    """Scale 0 (temperature 0): the allowed argmax, the first of tied ones (bf16 logits of few values tie often),
    as torch.argmax over the masked logits; u does not matter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, vocab), generator=g).to(torch.bfloat16)
    allowed = torch.rand(rows, vocab, generator=g) < 0.3 if masked else torch.ones(rows, vocab, dtype=torch.bool)
    allowed[:, -1] = True
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    got = ops.sample_rows(x, torch.arange(rows), torch.zeros(rows), u, pack(allowed) if masked else NO_MASK)
    assert torch.equal(got, x.float().masked_fill(~allowed, float("-inf")).argmax(-1))


def test_kernel_leaves_rows_whose_allowed_logits_are_not_finite_to_the_caller(ops) -> None:  # noqa: ANN001
    """-1 where an allowed logit is NaN or +inf, or every allowed one is -inf (the ATen path's rules decide those);
    a forbidden NaN or +inf is no concern of the row."""
    V = 300
    x = torch.randn(5, V)
    x[0, 7] = float("nan")
    x[1, 260] = float("inf")
    x[2, :] = float("-inf")
    x[3, 7], x[3, 260] = float("nan"), float("inf")  # forbidden in row 3 only
    x[4, 100] = float("inf")
    allowed = torch.ones(5, V, dtype=torch.bool)
    allowed[3, [7, 260]] = False
    u = torch.full((5,), 0.5, dtype=torch.float64)
    got = ops.sample_rows(x, torch.arange(5), torch.ones(5), u, pack(allowed)).tolist()
    assert got[:3] == [-1, -1, -1] and got[4] == -1
    assert 0 <= got[3] < V and got[3] not in (7, 260)
    assert ops.sample_rows(x[3:4], torch.arange(1), torch.ones(1), u[:1], NO_MASK).tolist() == [-1]


def test_kernel_keeps_the_most_likely_allowed_token_of_huge_logits(ops) -> None:  # noqa: ANN001
    """Logits of ~1e30 (a repetition penalty of 1e-30) at temperature 0.8: the most likely allowed token weighs 1,
    every other allowed one 0, so it is drawn whatever u is (x * scale - max * scale, fused into one FMA, once gave
    it weight 0 and drew a forbidden token)."""
    V = 257
    x = torch.randn(1, V) * 1e30
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [5, 97, 200]] = True
    best = 5 + 92 * int(x[0, 97] > x[0, 5])
    best = best if x[0, best] > x[0, 200] else 200
    for u in (0.0, 0.3, 1 - 2**-53):
        got = ops.sample_rows(x, torch.arange(1), torch.tensor([1.25]), torch.tensor([u], dtype=torch.float64),
                              pack(allowed))
        assert got.tolist() == [best]


def test_kernel_refuses_mismatched_arguments(ops) -> None:  # noqa: ANN001
    x, u = torch.randn(2, 40), torch.rand(2, dtype=torch.float64)
    bad = [
        (x.double(), torch.arange(2), torch.ones(2), u, NO_MASK),  # logits' dtype
        (x.t(), torch.arange(2), torch.ones(2), u, NO_MASK),  # not contiguous
        (x, torch.tensor([0, 2]), torch.ones(2), u, NO_MASK),  # a row out of range
        (x, torch.arange(2), torch.ones(3), u, NO_MASK),  # scale's length
        (x, torch.arange(2), torch.ones(2), u.float(), NO_MASK),  # u's dtype
        (x, torch.arange(2), torch.ones(2), u, torch.zeros(2, 1, dtype=torch.int32)),  # bits short of the vocabulary
    ]
    for args in bad:
        with pytest.raises(RuntimeError, match="sample_rows"):
            ops.sample_rows(*args)


@pytest.mark.parametrize("vocab", [65, 1000, 50257])
def test_sample_next_draws_the_same_tokens_with_and_without_the_kernel(monkeypatch, vocab) -> None:
    """Seeded rows at several temperatures, beside greedy ones, bf16 and fp32 logits: the kernel and the ATen path
    (softmax, inverse_cdf) give the same tokens from the same uniforms, but where a uniform falls within rounding of
    an edge between two tokens (~1e-7 of the total: at 50,257 tokens of ~2e-5 each, a draw in a few hundred), where
    they take the tokens either side of it; with a filter the kernel stays out."""
    if sampling.native_sampler(torch.zeros(1, 1)) is None:
        pytest.skip("gptlab's kernels are not built here: only the ATen path runs")
    torch.manual_seed(0)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 0, 1.3)] * 8
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(len(params), vocab) * 3).to(dtype)
        draws = []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(sampling, "native_sampler", lambda logits: None)
            gens = [torch.Generator().manual_seed(i) for i in range(len(params))]
            draws.append([sample_next(logits, params, gens) for _ in range(5)])
            monkeypatch.undo()
        native, aten = (torch.tensor(d).flatten() for d in draws)
        differ = native != aten
        assert differ.float().mean() < 0.02 and ((native - aten)[differ].abs() == 1).all()
    called = []
    monkeypatch.setattr(sampling, "native_sampler", lambda logits: called.append(1))
    sample_next(torch.randn(2, vocab), [SamplingParams(temperature=1.0, top_k=5)] * 2, [None, None])
    assert not called


@pytest.mark.parametrize("native", [True, False])
def test_a_temperature_past_fp32s_range_samples_its_limit(monkeypatch, native) -> None:
    """Any T > 0 is a temperature: one whose logits / T (the kernel's 1 / T) overflows fp32 draws the argmax, with
    or without a filter (not the last token, as a NaN softmax draws); one whose 1 / T underflows is no greedy row:
    it draws from the (nearly) uniform distribution."""
    if not native:
        monkeypatch.setattr(sampling, "native_sampler", lambda logits: None)
    torch.manual_seed(0)
    logits = torch.randn(8, 300) * 3
    best = logits.argmax(-1).tolist()
    for t in (1e-39, 1e-300, 5e-324):
        for extra in ({}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
            gens = [torch.Generator().manual_seed(i) for i in range(8)]
            assert sample_next(logits, [SamplingParams(temperature=t, **extra)] * 8, gens) == best, (t, extra)
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    hot = sample_next(logits[:1].expand(64, -1), [SamplingParams(temperature=1e300)] * 64, gens)
    assert len(set(hot)) > 30  # ~57 distinct tokens of 300 expected; a greedy row would give 1
