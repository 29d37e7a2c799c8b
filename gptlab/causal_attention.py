"""Causal attention in training on a CPU through gptlab's kernels, where they are faster than PyTorch's.

bf16: PyTorch's flash-attention forward, gptlab's backward. PyTorch's CPU flash-attention backward runs its products
as many small GEMM calls: ~14 ms a layer at GPT-2's 4 x 12 heads x 256 x 64 on a 2-core AMX Xeon, ~10x its own
forward. gptlab's (`gptlab.kernels`, attention_backward.cpp) packs each kv head's keys and values once and runs the
products on the CPU's bf16 dot products: 3.4 ms there on the tile unit (AMX), 7.4 ms with AVX512-BF16. The forward
is the op F.scaled_dot_product_attention runs here (the same output, and its log-sum-exp for the backward), so only
the gradients differ, within bf16 rounding. It serves sequence lengths and head sizes in multiples of 32 on a CPU
whose gptlab kernels have bf16 dot products (AVX512-BF16 or AMX).

fp32, sequences up to `FP32_MAX_LEN`: forward and backward both gptlab's (attention_fp32.cpp, every build): each
(batch, head)'s keys and values stay in the cache and every product runs on one register tile over a block of
query (or key) rows, where PyTorch's flash attention spends a short sequence's attention in calls of a few thousand
multiply-adds. On a 2-core Zen 3 (AVX2), forward and backward through autograd (`benchmarks/train_attention.py
--dtype float32`, raised priority, interleaved, best of 5-7): 1.55x PyTorch's at 32 x 2 heads x 64 x 32 (the CPU
speedrun's), 1.56-1.65x at 16 x 2 x 96 x 32, 8 x 2 x 128 x 32 and 4 x 2 x 256 x 32, 1.83x at GPT-2's 4 x 12 x 256 x
64 and 1.93x at 8 x 12 x 512 x 64, but 1.10x at 1 x 12 x 1,024 x 64, where the T x T probabilities and their
gradients (kept for the backward's key blocks) no longer fit the cache: it serves up to `FP32_MAX_LEN` positions
(past `FP32_SHORT_LEN` only with a (batch, kv head) for every 3 threads), heads in multiples of 16 (every build's
vector) up to `FP32_MAX_HEAD`. A scoring pass, which needs no backward, takes it up to `FP32_FORWARD_MAX_LEN`
positions. Within fp32 rounding of the maths. Not measured on an AVX-512 CPU, where the same source runs 16 lanes
wide and PyTorch's flash attention too.

Both serve plain causal attention (no mask, no dropout) over a whole sequence (as many keys as queries), grouped kv
heads included, in training (a gradient wanted) or a scoring pass, outside torch.compile;
tests/test_causal_attention.py holds them against the maths in fp64. Elsewhere `attention` returns None and
F.scaled_dot_product_attention runs.
"""

from __future__ import annotations

from typing import Any

import torch


class _CausalAttention(torch.autograd.Function):
    """Causal attention through the kernels `ops`: fp32 (`fp32`: gptlab's forward and backward) or bf16 (PyTorch's
    flash forward, gptlab's backward), whose backwards take the forward's log-sum-exp (and bf16's its output)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, ops, fp32):  # noqa: ANN001, ANN205
        if fp32:
            out, lse = ops.causal_attention_fp32(q, k, v, scale)  # out: (B, nh, T, hs), laid out (B, T, nh, hs)
        else:
            group = q.shape[1] // k.shape[1]
            keys, values = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, True,
                                                                                   scale=scale)[:2]
        ctx.save_for_backward(q, k, v, *([] if fp32 else [out]), lse)  # (fp32's sums rows of P dP instead of dO O)
        ctx.scale = scale
        ctx.backward_op = ops.causal_attention_fp32_backward if fp32 else ops.causal_attention_backward
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        dq, dk, dv = ctx.backward_op(grad, *ctx.saved_tensors, ctx.scale)
        return dq, dk, dv, None, None, None


# where the fp32 kernel serves (module docstring): the longest sequence measured clearly faster than PyTorch's flash
# attention (a 2-core Zen 3: 1.93x at 512 positions, 1.10x at 1,024, whose T x T backward buffers are 4 MB each a
# thread), and the widest head measured
FP32_MAX_LEN = 512
FP32_MAX_HEAD = 128
# The backward's unit of work is one (batch, kv head), the forward's one (batch, head); PyTorch's flash attention
# splits the queries too. Past FP32_SHORT_LEN positions (the limit measured before the register tiles) the kernel
# serves where its units keep the threads busy: a unit on one thread did the work of ~3 of PyTorch's (1 x 1 x 512 x
# 64 on the Zen 3: 1.93 ms on one thread against 2.92 ms on two), so at least one unit per 3 threads.
FP32_SHORT_LEN = 96
FP32_THREADS_PER_UNIT = 3
# a forward alone (a scoring pass: no backward, so no T x T buffers) serves longer sequences: 1.24x PyTorch's flash
# forward at 1 x 12 x 1,024 x 64 on the Zen 3, 1.03x at 2,048 (`evaluate_loss` of GPT-2 over 8,192 tokens in windows
# of 1,024, alternating: 14.52-14.61 s through PyTorch's, 14.06-14.14 s)
FP32_FORWARD_MAX_LEN = 1024


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs) through gptlab's kernels where they apply
    (module docstring), else None."""
    if not _plain_causal(q, k, v):
        return None
    fp32 = q.dtype == torch.float32
    ops = _fp32_ops(q, k, v) if fp32 else _bf16_ops(q, k, v)
    return None if ops is None else _CausalAttention.apply(q, k, v, scale, ops, fp32)


def _plain_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Keys and values of one shape, as many positions as queries, kv heads dividing the query heads, one dtype,
    each row's head dimension contiguous."""
    return (k.shape == v.shape and k.shape[2] == q.shape[2] and q.shape[1] % k.shape[1] == 0
            and all(t.dtype == q.dtype and t.stride(-1) == 1 for t in (k, v)) and q.stride(-1) == 1)


def _fp32_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any | None:
    from gptlab.kernels import gradient_wanted, training_ops

    hs, T = q.shape[3], q.shape[2]
    if hs % 16 or hs > FP32_MAX_HEAD or T > (FP32_MAX_LEN if gradient_wanted(q, k, v) else FP32_FORWARD_MAX_LEN):
        return None
    if T > FP32_SHORT_LEN and q.shape[0] * k.shape[1] * FP32_THREADS_PER_UNIT < torch.get_num_threads():
        return None

    return training_ops(q, k, v)  # a CPU, a gradient wanted or scoring, not compiling: every build has the kernel


def serves(head_size: int, seq_len: int) -> bool:
    """Whether bf16 training attention over sequences of `seq_len` with heads of `head_size` runs gptlab's backward
    on this CPU (its kernels built, with bf16 dot products): the trainer's choice of attention's dtype asks."""
    return head_size % 32 == 0 and seq_len % 32 == 0 and _bf16_dot_ops() is not None


def _bf16_dot_ops() -> Any | None:
    from gptlab.kernels import bf16_dot_ops

    return bf16_dot_ops()


def _bf16_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any | None:
    hs, T = q.shape[3], q.shape[2]
    if q.dtype != torch.bfloat16:
        return None
    from gptlab.kernels import takes_training_kernels

    # a CPU, a gradient wanted (or a scoring pass), not compiling; `serves`: the kernels built, with bf16 dot products
    if not takes_training_kernels(q, k, v) or not serves(hs, T):
        return None
    return _bf16_dot_ops()
