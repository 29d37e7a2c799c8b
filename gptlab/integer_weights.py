"""The integer formats of weight-only quantization, as arithmetic on tensors: int8 symmetric per output row, int4
asymmetric per group of consecutive inputs, and two int4 values packed a byte. Computed in fp32; `gptlab.quantize`
builds its layers and kernels on them, and QLoRA's frozen base (`gptlab.qlora`) stores them.
"""

from __future__ import annotations

import torch

_TINY = 1e-12  # the scale of an all-equal row or group: anything positive, q is then 0 (int8) or w = min (int4)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scale fp32 (N,)) with w ~ q * scale[:, None], symmetric per row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=_TINY)
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # in place: one fp32 temporary
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 (N, K) in [0, 15], scale fp32 (N, K / group_size), zero fp32 (same)) with
    w ~ (q - 8) * scale + zero within each group of `group_size` consecutive inputs.

    The scale and the group's low end (zero - 8 * scale) are fp16 values wherever fp16 holds them (weights below
    65504 in magnitude), so a kernel may store them in 2 bytes each without rounding (gptlab's does: it then reads
    0.625 bytes a weight at group 32, not 0.75). The low end is rounded down and the scale up, so the 16 levels
    still cover the group and every weight stays within scale / 2 of its level."""
    q, scale, low = quantize_int4_low(w, group_size)
    return q, scale, low + 8 * scale


def quantize_int4_low(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_int4` with each group's low end in place of its zero point: w ~ q * scale + low. One fp32 copy
    of `w` is the only temporary of its size (the arithmetic runs in place on it): QLoRA quantizes a large model
    one layer at a time as it loads, where that copy sets the peak."""
    n, k = w.shape
    groups = w.to(torch.float32, copy=True).reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    low = _fp16_toward(lo, down=True)
    scale = _fp16_toward(((hi - low) / 15).clamp(min=_TINY), down=False)
    q = groups.sub_(low[..., None]).div_(scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, low


def _fp16_toward(x: torch.Tensor, down: bool) -> torch.Tensor:
    """x (fp32) as the nearest fp16 value toward -inf (`down`) or +inf, in fp32; x itself where fp16 cannot hold it
    (beyond 65504)."""
    half = x.half()
    step = torch.nextafter(half, torch.full_like(half, float("-inf") if down else float("inf")))
    wrong_side = (half.float() > x) if down else (half.float() < x)
    out = torch.where(wrong_side, step, half).float()
    return torch.where(out.isfinite(), out, x)


def int4_params_fit_fp16(scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether int4's scale and low end (zero - 8 * scale) are fp16 values, which gptlab's kernel stores exactly."""
    low = zero - 8 * scale
    return all(torch.equal(t.half().float(), t) for t in (scale.float(), low.float()))


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    groups = q.reshape(n, scale.shape[1], -1).float() - 8
    return (groups * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K / 2) uint8, input 2j in the high nibble and 2j + 1 in the low one (the
    order CUDA's int4 packing reads)."""
    return (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1)
