"""An attention layer's q, k and v from its fused projection, in training on a CPU through one C++ kernel.

`CausalSelfAttention` cuts the projection's output into heads, casts them to the attention's dtype (fp32 under bf16
weights on a CPU), RMS-normalizes q and k (QK-norm) and rotates them (RoPE). In ATen that is ~35 small ops forward
and as many autograd nodes backward, each costing its dispatch whatever the tensor's size: at a small model's
shapes most of a training step's framework time (~5 ms of the CPU speedrun's ~18 ms step). `split_heads` does
it in one pass forward and one back (`gptlab.kernels`, split_heads.cpp), within fp32 rounding of the ops it
replaces (tests/test_heads.py checks values and gradients against them). Inference keeps ATen's ops: their bits
are what the Hugging Face parity tests and the decode steps follow.
"""

from __future__ import annotations

import torch


class _SplitHeads(torch.autograd.Function):
    """(q, k, v) from qkv (B, T, (nh + 2 nkv) hs) through the kernel `ops`; backward recomputes the norm from qkv."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, ops, shape, out_dtype):  # noqa: ANN001, ANN205
        ctx.save_for_backward(qkv, cos, sin)
        ctx.ops, ctx.shape = ops, shape
        q, k, v = ops.split_heads(qkv, cos, sin, *shape, out_dtype)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):  # noqa: ANN001, ANN205
        qkv, cos, sin = ctx.saved_tensors
        like = next(g for g in (dq, dk, dv) if g is not None)  # an output no loss reached has no gradient
        n_head, n_kv_head = ctx.shape[:2]
        B, T, width = qkv.shape
        hs = width // (n_head + 2 * n_kv_head)
        dq = dq if dq is not None else like.new_zeros(B, n_head, T, hs)
        dk = dk if dk is not None else like.new_zeros(B, n_kv_head, T, hs)
        dv = dv if dv is not None else like.new_zeros(B, n_kv_head, T, hs)
        return ctx.ops.split_heads_backward(dq, dk, dv, qkv, cos, sin, *ctx.shape), None, None, None, None, None


def split_heads(qkv: torch.Tensor, n_head: int, n_kv_head: int, rope: tuple[torch.Tensor, torch.Tensor] | None,
                interleaved: bool, qk_norm_eps: float | None, out_dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) in `out_dtype` from the fused projection qkv (B, T, (nh + 2 nkv)
    hs): q and k RMS-normalized without a weight where `qk_norm_eps` is set, then rotated by `rope`'s (cos, sin)
    ((1 or B, 1, T, rot / 2) fp32, `rope_tables`); v only cut and cast. Through the kernel where that pays: in
    training (qkv needs a gradient) on a CPU, fp32 or bf16, outside torch.compile (which fuses ATen's ops itself);
    None elsewhere, and the caller runs the ATen ops."""
    from gptlab.kernels import training_ops

    ops = training_ops(qkv) if out_dtype in (torch.float32, torch.bfloat16) else None
    if ops is None:
        return None
    if rope is None:
        cos = sin = qkv.new_empty(0, dtype=torch.float32)
    else:  # (1 or B, 1, T, half) -> (1 or B, T, half)
        cos, sin = (t.squeeze(1).to(torch.float32).contiguous() for t in rope)
    shape = (n_head, n_kv_head, interleaved, qk_norm_eps is not None, qk_norm_eps or 0.0)
    return _SplitHeads.apply(qkv.contiguous(), cos, sin, ops, shape, out_dtype)
