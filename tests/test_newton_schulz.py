"""kernels/newton_schulz.cpp: Muon's Newton-Schulz iteration over a stack of small matrices in one C++ call, in
every build this machine runs that has bf16 dot products, against the same iteration through ATen's bf16 products
(`gptlab.train.muon.newton_schulz` with the kernel off): equal up to the order of fp32 sums, each product rounded
to bf16 once in both; zero padding exact; used by Muon where it applies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.train import muon

COEFFICIENTS = (3.4445, -4.775, 2.0315)


def _builds() -> list[str]:
    from gptlab.kernels import kernel_builds

    return [name for name, ops in kernel_builds().items() if hasattr(ops, "newton_schulz")]


def _ops(name: str):  # noqa: ANN202 - a kernel build's ops
    from gptlab.kernels import kernel_builds

    if name not in _builds():
        pytest.skip(f"no {name} build with bf16 dot products on this machine")
    return kernel_builds()[name]


def _through(ops, g: torch.Tensor, monkeypatch: pytest.MonkeyPatch, steps: int = 5) -> torch.Tensor:  # noqa: ANN001
    """The bf16 iteration through `ops` (None: ATen's products), whether or not this CPU multiplies bf16 natively
    (an emulated build runs where it does not)."""
    monkeypatch.setattr(muon, "native_low_precision_matmul", lambda dtype: True)
    monkeypatch.setattr(muon, "_native_ops", lambda x: ops)
    return muon.newton_schulz(g, steps, COEFFICIENTS, 1e-7)


@pytest.mark.parametrize("build", ["avx512", "amx"])
@settings(max_examples=15, deadline=None)
@given(stack=st.integers(1, 5), rows=st.integers(1, 64), cols=st.integers(1, 256), steps=st.integers(0, 6),
       seed=st.integers(0, 1000))
def test_every_build_is_atens_iteration(build: str, stack: int, rows: int, cols: int, steps: int,
                                         seed: int) -> None:
    ops = _ops(build)
    g = torch.randn(stack, rows, cols, generator=torch.Generator().manual_seed(seed))
    with pytest.MonkeyPatch.context() as patch:
        want = _through(None, g, patch, steps)
        got = _through(ops, g, patch, steps)
    assert got.dtype == torch.bfloat16 and got.shape == g.shape
    # the same roundings, sums in another order: a bf16 step apart here and there (values up to ~1)
    difference = (got.float() - want.float()).abs()
    assert float(difference.max()) <= 2 ** -6 and float(difference.mean()) <= 2 ** -11


@pytest.mark.parametrize("build", ["avx512", "amx"])
def test_the_kernels_padding_is_exact_and_the_result_near_orthogonal(build: str, monkeypatch) -> None:  # noqa: ANN001
    """A matrix alone (padded inside to whole blocks of 32) and the same matrix zero-padded in a stack: the same bits;
    the result's singular values near 1, as Newton-Schulz's quintic leaves them (0.7-1.2)."""
    ops = _ops(build)
    m = torch.randn(24, 40, generator=torch.Generator().manual_seed(3))
    stack = torch.zeros(2, 48, 64)
    stack[0, :24, :40] = m
    stack[1] = torch.randn(48, 64)
    alone = _through(ops, m[None], monkeypatch)[0]
    together = _through(ops, stack, monkeypatch)
    assert torch.equal(together[0, :24, :40], alone)
    assert not together[0, 24:].any() and not together[0, :, 40:].any()
    singular = torch.linalg.svdvals(alone.float())
    assert float(singular.min()) > 0.6 and float(singular.max()) < 1.25


def test_the_kernel_refuses_what_it_does_not_take() -> None:
    builds = _builds()
    if not builds:
        pytest.skip("no build with bf16 dot products on this machine")
    ops = _ops(builds[0])
    with pytest.raises(RuntimeError, match="wide matrices"):
        ops.newton_schulz(torch.zeros(1, 8, 4, dtype=torch.bfloat16), 5, *COEFFICIENTS)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.newton_schulz(torch.zeros(1, 4, 8), 5, *COEFFICIENTS)


def test_muon_takes_the_kernel_for_small_stacks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this CPU has a build with bf16 dot products, the speedrun's stack (8 x 64 x 256) goes through it, a
    larger one (measured slower there) and a stack being compiled do not."""
    from gptlab.kernels import bf16_dot_ops

    small = torch.zeros(8, 64, 256, dtype=torch.bfloat16)
    assert (muon._native_ops(small) is not None) is (bf16_dot_ops() is not None)
    assert muon._native_ops(torch.zeros(2, 128, 256, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert muon._native_ops(small) is None
