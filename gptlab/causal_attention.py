"""Causal attention in bf16 training on a CPU: PyTorch's flash-attention forward, gptlab's backward.

PyTorch's CPU flash-attention backward runs its products as many small GEMM calls: ~14 ms a layer at GPT-2's 4 x 12
heads x 256 x 64 on a 2-core AMX Xeon, ~10x its own forward. gptlab's (`gptlab.kernels`,
attention_backward.cpp) packs each kv head's keys and values once and runs the products on the CPU's bf16 dot
products: 3.4 ms there on the tile unit (AMX), 7.4 ms with AVX512-BF16. The forward is the op F.scaled_dot_product
_attention runs here (the same output, and its log-sum-exp for the backward), so only the gradients differ, within
bf16 rounding (tests/test_causal_attention.py: both against the maths in fp64, no further from it than PyTorch's).

It serves plain causal attention (no mask, no dropout) over a whole sequence (as many keys as queries), with
sequence length and head size multiples of 32, grouped kv heads included, in training (a gradient wanted) on a
CPU whose gptlab kernels have bf16 dot products (AVX512-BF16 or AMX), outside torch.compile. Elsewhere
`attention` returns None and F.scaled_dot_product_attention runs.
"""

from __future__ import annotations

from typing import Any

import torch


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, ops):  # noqa: ANN001, ANN205
        group = q.shape[1] // k.shape[1]
        keys, values = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, True,
                                                                               scale=scale)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.ops = scale, ops
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        dq, dk, dv = ctx.ops.causal_attention_backward(grad, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs) through gptlab's backward where it applies
    (module docstring), else None."""
    ops = _ops(q, k, v)
    if ops is None:
        return None
    return _CausalAttention.apply(q, k, v, scale, ops)


def serves(head_size: int, seq_len: int) -> bool:
    """Whether bf16 training attention over sequences of `seq_len` with heads of `head_size` runs gptlab's backward
    on this CPU (its kernels built, with bf16 dot products): the trainer's choice of attention's dtype asks."""
    return head_size % 32 == 0 and seq_len % 32 == 0 and _bf16_dot_ops() is not None


def _bf16_dot_ops() -> Any | None:
    from gptlab.kernels import bf16_dot_ops

    return bf16_dot_ops()


def _ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any | None:
    B, nh, T, hs = q.shape
    if (k.shape != v.shape or k.shape[2] != T or nh % k.shape[1]
            or any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in (q, k, v))):
        return None
    from gptlab.kernels import trains_on_cpu

    if not trains_on_cpu(q, k, v) or not serves(hs, T):  # a CPU, a gradient wanted, not compiling; the kernels
        return None
    return _bf16_dot_ops()
