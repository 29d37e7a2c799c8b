"""`gptlab.causal_attention`'s fp32 path: causal attention of short sequences, forward and backward, in fp32
training on a CPU (kernels/attention_fp32.cpp). Every build this machine runs against the maths in fp64, no further
from it than PyTorch's own flash attention; strided rows; the output's layout; where it serves; a model's loss and
gradients through it against the same model through F.scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import causal_attention_fp64
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import causal_attention
from gptlab.config import GPTConfig
from gptlab.model import GPT


def _ops(build_name: str):  # noqa: ANN202 - the build's ops
    from gptlab.kernels import kernel_builds

    return kernel_builds()[build_name]


def _relative(a: torch.Tensor, want: torch.Tensor) -> float:
    return float((a.double() - want).norm() / want.norm())


def _gradient_magnitudes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, scale: float,
                         ) -> tuple[torch.Tensor, ...]:
    """What each gradient's fp32 rounding scales with, in fp64: its sums written over the terms' magnitudes. dS =
    P (dP - rowsum(P dP)) cancels where a row's dP are near their mean (a one-key row's is exactly zero), so an error
    relative to the gradient itself is unbounded there; relative to these it is a few ulps."""
    q, k, v, grad = (t.double() for t in (q, k, v, grad))
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    T = q.shape[2]
    scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                              float("-inf"))
    p = scores.softmax(-1)
    dp = grad.abs() @ values.abs().transpose(-1, -2)  # |dO| |V|^T
    ds = scale * p * (dp + (p * dp).sum(-1, keepdim=True))

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], k.shape[1], group, *t.shape[2:]).sum(2)

    return (ds @ keys.abs(), per_kv_head(ds.transpose(-1, -2) @ q.abs()),
            per_kv_head(p.transpose(-1, -2) @ grad.abs()))


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3]),
       T=st.integers(1, 80) | st.sampled_from([127, 200, 263]),
       head_size=st.sampled_from([16, 32, 48, 64, 128]), scale=st.floats(0.05, 0.5), seed=st.integers(0, 10_000))
def test_every_builds_attention_is_the_maths_in_fp64(build_name: str, batch: int, kv_heads: int, group: int, T: int,
                                                     head_size: int, scale: float, seed: int) -> None:
    """Any length (whole vectors of keys or not, whole blocks of query rows or not, past the L1 cache), head sizes in
    multiples of 16, grouped kv heads, any scale: the output and its log-sum-exp within fp32 rounding of fp64's (1e-6
    relative), each gradient's entries within 1e-5 of the magnitude of their terms, or no further than twice
    PyTorch's fp32 flash attention (kv heads repeated, its key and value gradients summed over each group)."""
    ops = _ops(build_name)
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(batch, heads, T, head_size, generator=g)
    k, v = (torch.randn(batch, kv_heads, T, head_size, generator=g) for _ in range(2))
    grad = torch.randn(batch, heads, T, head_size, generator=g)
    out, lse = ops.causal_attention_fp32(q, k, v, scale)
    grads = ops.causal_attention_fp32_backward(grad, q, k, v, lse, scale)
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t_out, t_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, True,
                                                                               scale=scale)[:2]
    theirs = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, keys, values, t_out, t_lse,
                                                                                 0.0, True, scale=scale)
    theirs = (theirs[0], *(t.view(batch, kv_heads, group, T, head_size).sum(2) for t in theirs[1:]))
    want_out, want_lse, *want_grads = causal_attention_fp64(q, k, v, grad, scale)
    assert out.shape == want_out.shape and out.dtype == torch.float32
    assert torch.allclose(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    assert _relative(out, want_out) <= max(2 * _relative(t_out, want_out), 1e-6)
    magnitudes = _gradient_magnitudes(q, k, v, grad, scale)
    for name, mine, torchs, want, size in zip("qkv", grads, theirs, want_grads, magnitudes, strict=True):
        assert mine.shape == want.shape and mine.dtype == torch.float32, name
        mine_off, torchs_off = ((t.double() - want).abs() / (size + 1e-30) for t in (mine, torchs))
        assert float(mine_off.max()) <= max(2 * float(torchs_off.max()), 1e-5), name


def test_rows_may_be_strided_and_the_output_is_laid_out_for_the_projection(build_name: str) -> None:
    """q, k, v and the output's gradient laid out (B, T, H, D), as the model's heads and the output projection's
    gradient are: the same results as from contiguous copies. The output is (B, H, T, D) over (B, T, H, D) memory,
    which the output projection reads without a copy."""
    ops = _ops(build_name)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 40, 3, 32, generator=g).transpose(1, 2) for _ in range(4))
    out, lse = ops.causal_attention_fp32(q, k, v, 0.2)
    dense_out, dense_lse = ops.causal_attention_fp32(q.contiguous(), k.contiguous(), v.contiguous(), 0.2)
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)
    assert out.transpose(1, 2).is_contiguous()
    strided = ops.causal_attention_fp32_backward(grad, q, k, v, lse, 0.2)
    dense = ops.causal_attention_fp32_backward(*(t.contiguous() for t in (grad, q, k, v)), lse, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(strided, dense, strict=True))


def test_the_kernel_refuses_what_it_does_not_compute(build_name: str) -> None:
    ops = _ops(build_name)
    q = torch.randn(1, 2, 8, 36)  # no multiple of any build's vector
    with pytest.raises(RuntimeError, match="D must be a multiple of"):
        ops.causal_attention_fp32(q, q, q, 0.2)
    q = torch.randn(1, 3, 8, 32)
    with pytest.raises(RuntimeError, match="Hkv dividing H"):
        ops.causal_attention_fp32(q, torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32), 0.2)
    with pytest.raises(RuntimeError, match="fp32 CPU tensors"):
        ops.causal_attention_fp32(q.double(), q.double(), q.double(), 0.2)


def _qkv(T: int = 64, D: int = 32, grad: bool = True) -> list[torch.Tensor]:
    return [torch.randn(2, 2, T, D, requires_grad=grad) for _ in range(3)]


def test_it_serves_fp32_training_of_short_sequences_only() -> None:
    """No gradient, a sequence past FP32_MAX_LEN, a head off the multiples of 16 or past FP32_MAX_HEAD, keys of
    another length than the queries, a sequence past FP32_SHORT_LEN with fewer units than a third of the threads: None
    (F.scaled_dot_product_attention runs); a scoring pass up to FP32_FORWARD_MAX_LEN. Where it serves: the maths."""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("gptlab's kernels do not run here")
    assert causal_attention.attention(*_qkv(grad=False), 0.2) is None
    with torch.no_grad():
        assert causal_attention.attention(*_qkv(), 0.2) is None
    assert causal_attention.attention(*_qkv(T=causal_attention.FP32_MAX_LEN + 1), 0.2) is None
    assert causal_attention.attention(*_qkv(D=40), 0.2) is None
    assert causal_attention.attention(*_qkv(D=causal_attention.FP32_MAX_HEAD + 16), 0.2) is None
    q, k, v = _qkv()
    assert causal_attention.attention(q, k[:, :, :32], v[:, :, :32], 0.2) is None
    from gptlab.kernels import scoring

    with torch.no_grad(), scoring():  # a forward alone serves longer sequences: no T x T buffers to keep
        long = _qkv(T=causal_attention.FP32_MAX_LEN + 1, grad=False)
        y = causal_attention.attention(*long, 0.2)
        assert y is not None
        torch.testing.assert_close(y, F.scaled_dot_product_attention(*long, is_causal=True, scale=0.2),
                                   rtol=1e-5, atol=1e-6)
        assert causal_attention.attention(*_qkv(T=causal_attention.FP32_FORWARD_MAX_LEN + 1, grad=False), 0.2) is None
    threads = torch.get_num_threads()
    try:  # past FP32_SHORT_LEN, too few (batch, kv head) units for the threads: PyTorch's, which splits the queries
        torch.set_num_threads(2 * 2 * causal_attention.FP32_THREADS_PER_UNIT + 1)  # _qkv: 2 x 2 units
        assert causal_attention.attention(*_qkv(T=causal_attention.FP32_SHORT_LEN + 1), 0.2) is None
        assert causal_attention.attention(*_qkv(T=causal_attention.FP32_SHORT_LEN), 0.2) is not None
        torch.set_num_threads(2 * 2 * causal_attention.FP32_THREADS_PER_UNIT)
        assert causal_attention.attention(*_qkv(T=causal_attention.FP32_SHORT_LEN + 1), 0.2) is not None
    finally:
        torch.set_num_threads(threads)
    y = causal_attention.attention(q, k, v, 0.2)
    assert y is not None
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("n_kv_head", "T"), [(4, 64), (2, 64), (2, 200)])
def test_a_models_loss_and_gradients_match_torchs_attention(n_kv_head: int, T: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 model (RoPE, QK-norm, grouped kv heads) trained through the kernel against the same model through
    F.scaled_dot_product_attention: loss and every gradient within fp32 rounding (a short sequence, and one past
    FP32_SHORT_LEN, served here whatever the thread count)."""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("gptlab's kernels do not run here")
    monkeypatch.setattr(causal_attention, "FP32_THREADS_PER_UNIT", 1 << 20)
    rows = torch.randint(0, 300, (3, T + 1), generator=torch.Generator().manual_seed(1))
    calls = []
    real = causal_attention._CausalAttention.apply
    monkeypatch.setattr(causal_attention._CausalAttention, "apply", lambda *a: calls.append(1) or real(*a))

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", n_layer=2, n_embd=128, n_head=4, n_kv_head=n_kv_head, block_size=T,
                                     vocab_size=300, qk_norm=True))
        _, loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    ours = loss_and_grads()
    assert len(calls) == 2  # both layers took the kernel
    monkeypatch.setattr(causal_attention, "_fp32_ops", lambda q, k, v: None)
    theirs = loss_and_grads()
    assert len(calls) == 2
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
