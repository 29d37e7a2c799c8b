"""AdamW's step from bf16 working gradients in one pass (kernels/adamw.cpp, `FlatCopy.adamw_step`): every build this
machine runs against torch's fused AdamW on the same gradients widened to fp32, the working weights exactly the
updated masters rounded to bf16, a skipped step changing nothing, and the clipping's sum of squares against fp64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.kernels import kernel_builds


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 70_000), min_size=1, max_size=3), steps=st.integers(1, 3),
       lr=st.floats(1e-4, 0.1), weight_decay=st.sampled_from([0.0, 0.1]), beta1=st.sampled_from([0.0, 0.8, 0.9]),
       beta2=st.sampled_from([0.95, 0.999]), eps=st.sampled_from([1e-8, 1e-6]), scale=st.sampled_from([1.0, 0.37]),
       seed=st.integers(0, 10_000))
def test_every_builds_adamw_step_is_torchs_fused_adamw(build_name: str, sizes: list[int], steps: int, lr: float,
                                                        weight_decay: float, beta1: float, beta2: float, eps: float,
                                                        scale: float, seed: int) -> None:
    """Tensors of any size (a vector's remainder, more than one chunk of work), several steps (the bias
    corrections), any betas (beta1 0 takes the lerp's other branch) and a clipping scale: the masters and both
    moments within fp32 rounding of torch's fused AdamW given the same gradients, already scaled, in fp32."""
    ops = kernel_builds()[build_name]
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]
    reference = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(reference, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, fused=True)
    moments = [(torch.zeros(n), torch.zeros(n)) for n in sizes]
    counts = [torch.zeros(()) for _ in sizes]
    working = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    for _ in range(steps):
        grads = [(torch.randn(n, generator=g) * 0.1).bfloat16() for n in sizes]
        for r, grad in zip(reference, grads, strict=True):
            r.grad = grad.float() * scale
        opt.step()
        ops.adamw_working(params, grads, [m for m, _ in moments], [v for _, v in moments], working, counts, lr,
                          beta1, beta2, weight_decay, eps, scale, None)
    for p, r, (m, v), w, count in zip(params, reference, moments, working, counts, strict=True):
        state = opt.state[r]
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, state["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-6, atol=1e-12)
        assert torch.equal(w, p.to(torch.bfloat16))  # rounded as torch rounds: to nearest, ties to even
        assert float(count) == steps


def test_every_builds_adamw_step_skipped_changes_nothing(build_name: str) -> None:
    """found_inf set (a non-finite loss): no weight, moment, working weight or step count moves."""
    ops = kernel_builds()[build_name]
    p, m, v, count = torch.randn(100), torch.randn(100), torch.rand(100), torch.tensor(3.0)
    w = torch.zeros(100, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, w, count)]
    ops.adamw_working([p], [torch.randn(100).bfloat16()], [m], [v], [w], [count], 0.1, 0.9, 0.95, 0.1, 1e-8, 1.0,
                      torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip((p, m, v, w, count), before, strict=True))
    ops.adamw_working([p], [torch.randn(100).bfloat16()], [m], [v], [w], [count], 0.1, 0.9, 0.95, 0.1, 1e-8, 1.0,
                      torch.tensor(False))
    assert float(count) == 4.0 and not torch.equal(p, before[0])


@pytest.mark.parametrize("sizes", [[1], [17, 300_001], [1 << 20, 5]])
def test_every_builds_sum_of_squares_is_the_fp64_one(build_name: str, sizes: list[int]) -> None:
    """The gradients' squared global norm, bf16 and fp32 tensors alike, within 1e-6 of the fp64 sum."""
    ops = kernel_builds()[build_name]
    g = torch.Generator().manual_seed(len(sizes))
    tensors = [torch.randn(n, generator=g).to(dtype) for n, dtype in zip(sizes, [torch.bfloat16, torch.float32] * 2,
                                                                          strict=False)]
    want = sum(float(t.double().square().sum()) for t in tensors)
    assert abs(ops.sum_squares(tensors) - want) <= 1e-6 * want


def test_adamw_step_refuses_mismatched_lists(build_name: str) -> None:
    ops = kernel_builds()[build_name]
    p = torch.randn(10)
    with pytest.raises(RuntimeError, match="grads must have one tensor per parameter"):
        ops.adamw_working([p], [], [torch.zeros(10)], [torch.zeros(10)], [], [torch.zeros(())], 0.1, 0.9, 0.95, 0.0,
                          1e-8, 1.0, None)
    with pytest.raises(RuntimeError, match="exp_avgs must be contiguous CPU tensors"):
        ops.adamw_working([p], [torch.randn(10).bfloat16()], [torch.zeros(9)], [torch.zeros(10)], [],
                          [torch.zeros(())], 0.1, 0.9, 0.95, 0.0, 1e-8, 1.0, None)
