"""`gptlab.heads.split_heads`, the training kernel that cuts q, k and v out of the attention's projection, casts
them, QK-normalizes and rotates q and k: every build this machine runs against the maths in fp64 (values and
gradients, every layout the model has), and a model's training step through it against the same step through
ATen's ops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import attention, heads
from gptlab.config import GPTConfig
from gptlab.model import GPT
from gptlab.presets import PRESETS

pytestmark = pytest.mark.usefixtures("one_thread")


def _maths(qkv: torch.Tensor, n_head: int, n_kv_head: int, cos: torch.Tensor | None, sin: torch.Tensor | None,
           interleaved: bool, eps: float | None) -> tuple[torch.Tensor, ...]:
    """q, k, v from the definitions, pair by pair, in qkv's dtype (fp64 here): x / sqrt(mean(x^2) + eps), then each
    pair (a, b) of the first 2 * half dims turned to (a cos - b sin, b cos + a sin)."""
    B, T, width = qkv.shape
    hs = width // (n_head + 2 * n_kv_head)
    x = qkv.view(B, T, n_head + 2 * n_kv_head, hs).transpose(1, 2)  # (B, heads, T, hs)
    qk, v = x[:, : n_head + n_kv_head], x[:, n_head + n_kv_head :]
    if eps is not None:
        qk = qk / torch.sqrt((qk * qk).mean(-1, keepdim=True) + eps)
    if cos is not None:
        half = cos.shape[-1]
        c, s = cos.to(qk.dtype)[:, None], sin.to(qk.dtype)[:, None]  # (1 or B, 1, T, half)
        first = torch.arange(half) * 2 if interleaved else torch.arange(half)
        second = first + 1 if interleaved else first + half
        a, b = qk[..., first], qk[..., second]
        turned = qk.clone()
        turned[..., first], turned[..., second] = a * c - b * s, b * c + a * s
        qk = turned
    return qk[:, :n_head], qk[:, n_head:], v


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 9), n_kv_head=st.integers(1, 3), groups=st.integers(1, 3),
       half_hs=st.integers(1, 40), rotated=st.sampled_from(["all", "part", "none"]), interleaved=st.booleans(),
       norm=st.booleans(), per_row=st.booleans(), dtypes=st.sampled_from(["fp32", "bf16->fp32", "bf16"]),
       seed=st.integers(0, 10_000))
def test_every_builds_split_heads_is_the_maths_in_fp64(build_name: str, B: int, T: int, n_kv_head: int,
                                                        groups: int, half_hs: int, rotated: str, interleaved: bool,
                                                        norm: bool, per_row: bool, dtypes: str, seed: int) -> None:
    """Forward and backward of each build against fp64 autograd through `_maths`: any head size (vector
    remainders), grouped kv heads, full, partial or no rotation, both pair layouts, with or without the norm,
    shared or per-row positions; fp32 within fp32 rounding, bf16 outputs and gradients rounded once."""
    from gptlab.kernels import kernel_builds

    ops = kernel_builds()[build_name]
    g = torch.Generator().manual_seed(seed)
    n_head, hs = n_kv_head * groups, 2 * half_hs
    in_dtype = torch.float32 if dtypes == "fp32" else torch.bfloat16
    out_dtype = torch.bfloat16 if dtypes == "bf16" else torch.float32
    qkv = (torch.randn(B, T, (n_head + 2 * n_kv_head) * hs, generator=g) * 3).to(in_dtype)
    half = {"all": half_hs, "part": max(1, half_hs // 2), "none": 0}[rotated]
    angles = torch.rand(B if per_row else 1, T, half, generator=g) * 100
    cos, sin = (angles.cos(), angles.sin()) if half else (torch.empty(0), torch.empty(0))
    eps = 1e-5 if norm else None
    shape = (n_head, n_kv_head, interleaved, norm, eps or 0.0)

    ours = ops.split_heads(qkv, cos, sin, *shape, out_dtype)
    ref_in = qkv.double().requires_grad_()
    theirs = _maths(ref_in, n_head, n_kv_head, cos if half else None, sin if half else None, interleaved, eps)
    ups = [torch.randn(t.shape, generator=g).to(out_dtype) for t in theirs]
    (want_grad,) = torch.autograd.grad(theirs, ref_in, [u.double() for u in ups])
    grad = ops.split_heads_backward(*ups, qkv, cos, sin, *shape)

    low = out_dtype == torch.bfloat16
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == out_dtype and a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a.double(), b.detach(), rtol=2**-8 if low else 2e-6, atol=1e-5)
    assert grad.dtype == in_dtype and grad.shape == qkv.shape
    largest = float(want_grad.abs().max())  # the norm's backward sums terms that cancel
    torch.testing.assert_close(grad.double(), want_grad, rtol=2**-7 if in_dtype == torch.bfloat16 else 1e-5,
                               atol=2**-7 * largest if in_dtype == torch.bfloat16 else 1e-5 * largest)


def _model(**overrides) -> GPT:  # noqa: ANN003
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**PRESETS["speedrun-char"], **overrides}))


@pytest.mark.parametrize("overrides", [dict(), dict(n_head=4, n_kv_head=2), dict(qk_norm=False),
                                       dict(rope_interleaved=True, rotary_fraction=0.5), dict(position="learned")],
                         ids=["speedrun", "gqa", "no-qk-norm", "interleaved-partial", "no-rope"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-fp32-attention"])
def test_a_training_step_through_the_kernel_is_the_one_through_atens_ops(overrides: dict, bf16: bool,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss and every parameter's gradient of a model whose attention cuts its heads in the kernel against the
    same model through ATen's ops (`CausalSelfAttention._heads`), as the trainer runs it: fp32, or bf16 weights with
    fp32 attention."""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    model = _model(**overrides)
    if bf16:
        model = model.to(torch.bfloat16)
        model.set_attention_dtype(torch.float32)
    x = torch.randint(0, 65, (3, 40), generator=torch.Generator().manual_seed(1))

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(x[:, :-1])[0]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad.float() for p in model.parameters()]

    used = []
    real = heads.split_heads
    monkeypatch.setattr(attention, "split_heads", lambda *a: used.append(out := real(*a)) or out)
    loss, grads = loss_and_grads()
    assert used and all(out is not None for out in used)  # every layer ran the kernel
    monkeypatch.setattr(attention, "split_heads", lambda *a: None)
    ref_loss, ref_grads = loss_and_grads()
    tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, **tol)


def test_inference_keeps_atens_ops() -> None:
    """Without a gradient (sampling, evaluation) the kernel stays out: the logits are those of ATen's ops, bit for
    bit, which the Hugging Face parity tests and the decode steps follow."""
    model = _model()
    x = torch.randint(0, 65, (2, 30), generator=torch.Generator().manual_seed(2))
    qkv = torch.randn(2, 30, 192, requires_grad=True)
    with torch.no_grad():
        assert heads.split_heads(qkv, 2, 2, None, False, 1e-5, torch.float32) is None
        logits = model(x)[0]
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "split_heads", lambda *a: None)
        assert torch.equal(logits, model(x)[0])
