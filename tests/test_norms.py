"""`gptlab.norms`: the model's LayerNorm and RMSNorm, whose forward in training on a CPU runs gptlab's kernel. Every
build this machine runs against the maths in fp64 (values, the input's, weight's and bias's gradients), and the
modules against torch's: the same in training within rounding, the same bits outside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import norms

pytestmark = pytest.mark.usefixtures("one_thread")


def _maths(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, rms: bool) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b per row (RMSNorm: x / sqrt(mean(x^2) + eps) * w), in x's dtype."""
    centred = x if rms else x - x.mean(-1, keepdim=True)
    y = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)
    y = y if w is None else y * w
    return y if b is None else y + b


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), c=st.integers(1, 100), rms=st.booleans(), params=st.sampled_from(["", "w", "wb"]),
       bf16=st.booleans(), fp32_params=st.booleans(), seed=st.integers(0, 10_000))
def test_every_builds_norm_is_the_maths_in_fp64(build_name: str, rows: int, c: int, rms: bool, params: str,
                                                bf16: bool, fp32_params: bool, seed: int) -> None:
    """Forward and backward of each build against fp64 autograd through `_maths`: any row length (vector
    remainders), rows over several blocks of the weight's gradient sums, with or without weight and bias, bf16 rows
    with bf16 or fp32 parameters; fp32 within fp32 rounding, bf16 rounded once."""
    from gptlab.kernels import kernel_builds

    if rms and params == "wb":
        params = "w"  # RMSNorm has no bias
    ops = kernel_builds()[build_name]
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    pdtype = torch.float32 if fp32_params else dtype
    x = (torch.randn(rows, c, generator=g) * 3 + 2).to(dtype)
    w = (torch.randn(c, generator=g) + 1).to(pdtype) if "w" in params else None
    b = torch.randn(c, generator=g).to(pdtype) if "b" in params else None
    up = torch.randn(rows, c, generator=g).to(dtype)

    y, mean, rstd = ops.norm_rows(x, w, b, 1e-5, rms)
    dx, dw, db = ops.norm_rows_backward(up, x, w, mean, rstd, rms, w is not None, b is not None, pdtype)
    refs = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    want = _maths(*refs, 1e-5, rms)
    grads = torch.autograd.grad(want, [t for t in refs if t is not None], up.double())

    low = dict(rtol=2**-7, atol=2**-7)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), want.detach(), **(low if bf16 else dict(rtol=1e-5, atol=1e-5)))
    ours = [dx] + ([dw] if w is not None else []) + ([db] if b is not None else [])
    # the backward's sums cancel (a row of one value has dx = 0; the weight's gradient sums g xhat over rows of either
    # sign): within a few ulps of the largest term summed, for dx rstd |g w|, for the weight's and bias's gradients
    # the column sums of |g xhat| and |g|
    xhat = _maths(refs[0].detach(), None, None, 1e-5, rms)
    terms = [float(rstd.max() * up.abs().max().float() * (1.0 if w is None else w.abs().max().float()))]
    terms += [float((up.double() * xhat).abs().sum(0).max())] if w is not None else []
    terms += [float(up.double().abs().sum(0).max())] if b is not None else []
    for mine, theirs, summed in zip(ours, grads, terms, strict=True):
        largest = max(float(theirs.abs().max()), summed)
        tol = dict(rtol=2**-7, atol=2**-7 * largest) if mine.dtype == torch.bfloat16 or bf16 else \
            dict(rtol=1e-5, atol=1e-5 * largest)
        torch.testing.assert_close(mine.double(), theirs, **tol)
    if w is None:
        assert dw.numel() == 0
    else:
        assert dw.dtype == pdtype


@pytest.mark.parametrize("kind", ["layernorm", "layernorm-bias", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_modules_train_as_torchs_and_infer_with_its_bits(kind: str, dtype: torch.dtype) -> None:
    """gptlab's LayerNorm / RMSNorm against torch's with the same parameters: in training the kernel ran and the
    output and every gradient agree within rounding; without a gradient the output is torch's, bit for bit."""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    torch.manual_seed(0)
    if kind == "rmsnorm":
        ours, theirs = norms.RMSNorm(48, eps=1e-6), nn.RMSNorm(48, eps=1e-6)
    else:
        ours, theirs = (norms.LayerNorm(48, bias=kind.endswith("bias")), nn.LayerNorm(48, bias=kind.endswith("bias")))
    for p in ours.parameters():
        nn.init.normal_(p)
    theirs.load_state_dict(ours.state_dict())
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(3, 70, 48) * 2).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(a), theirs(b)
    assert "NormRows" in type(ya.grad_fn).__name__  # the kernel ran
    up = torch.randn(ya.shape).to(dtype)
    ga = torch.autograd.grad(ya, [a, *ours.parameters()], up)
    gb = torch.autograd.grad(yb, [b, *theirs.parameters()], up)
    tol = dict(rtol=2**-7, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ya, yb, **tol)
    for u, v in zip(ga, gb, strict=True):
        largest = float(v.abs().max())
        torch.testing.assert_close(u.float(), v.float(), rtol=tol["rtol"], atol=tol["atol"] * max(1.0, largest))


def test_wide_fp32_layer_norms_keep_atens() -> None:
    """fp32 LayerNorm rows of 256 values or more take ATen's fused kernel (the faster there); bf16 ones and RMSNorm
    take gptlab's at any width."""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    x, w = torch.randn(4, 300, requires_grad=True), torch.ones(300, requires_grad=True)
    assert "NativeLayerNorm" in type(norms.layer_norm(x, (300,), w).grad_fn).__name__
    assert "NormRows" in type(norms.layer_norm(x.bfloat16(), (300,), w.bfloat16()).grad_fn).__name__
    assert "NormRows" in type(norms.rms_norm(x, (300,), w).grad_fn).__name__
