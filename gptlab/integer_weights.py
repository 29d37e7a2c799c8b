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

    Each group's grid is the one of least squared error among a few: the min/max grid (`quantize_int4_low`), and
    for each of `_GRID_SLACK`'s level counts, the weights rounded onto it and the scale and low end refitted to
    them by least squares. About 0.83x the min/max grid's squared error on Gaussian weights, for about 7x its
    time (0.4-0.5 s for 16.7M weights on 2 cores: a few minutes for a 7B model). The scale and the low end
    (zero - 8 * scale) are fp16 values wherever fp16 holds them (weights below 65504 in magnitude), so a kernel may
    store them in 2 bytes each without rounding (gptlab's does: it then reads 0.625 bytes a weight at group 32)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, k // group_size, device=w.device)
    low = torch.empty_like(scale)
    step = max(1, _FIT_ELEMENTS // max(k, 1))  # rows at a time: a few fp32 temporaries of this size
    for r in range(0, n, step):
        q[r:r + step], scale[r:r + step], low[r:r + step] = _fitted_int4(w[r:r + step], group_size)
    return q, scale, low + 8 * scale


_GRID_SLACK = (-0.5, 0.0, 0.5, 1.0, 1.5)  # levels beyond 15 that each group's [min, max] spans before the refit
_FIT_ELEMENTS = 1 << 22


def _fitted_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_int4_low`'s (q, scale, low) with each group's grid the least-squares one (see `quantize_int4`).
    Candidates are scored by their squared error from the group's sums (no pass over the weights per score), in
    coordinates relative to the group's minimum so that groups far from zero lose no precision to cancellation;
    the winner's q is then each weight's nearest level, which can only lower that error, and the min/max grid is
    kept wherever the winner's error, measured weight by weight, is not lower."""
    q0, scale0, low0 = quantize_int4_low(w, group_size)
    n, k = w.shape
    g = w.to(torch.float32, copy=True).reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    g.sub_(lo[..., None])  # (N, G, group): each group from its minimum
    size = float(group_size)
    sw, sww = g.sum(dim=-1), g.square().sum(dim=-1)

    def sums(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """per group: sum(q), sum(q^2), sum(q g)"""
        return q.sum(dim=-1), q.square().sum(dim=-1), (q * g).sum(dim=-1)

    def error(s: torch.Tensor, m: torch.Tensor, sq: torch.Tensor, sqq: torch.Tensor,
              sqw: torch.Tensor) -> torch.Tensor:
        """sum((q s + m - g)^2) per group, from the sums"""
        e = s * s * sqq + 2 * s * m * sq + size * m * m - 2 * s * sqw - 2 * m * sw + sww
        return torch.where(s.isfinite() & m.isfinite() & (s > 0), e, torch.inf)

    best_s, best_low = scale0, low0
    best = error(scale0, low0 - lo, *sums(q0.reshape(g.shape).float()))
    span = (hi - lo).clamp(min=_TINY)
    for slack in _GRID_SLACK:
        q = (g * ((15 + slack) / span)[..., None]).round_().clamp_(0, 15)
        sq, sqq, sqw = sums(q)
        det = size * sqq - sq * sq  # 0 where every weight took one level: the min/max grid stays
        s = _fp16_nearest((size * sqw - sq * sw) / det)
        low = _fp16_nearest(lo + (sw - s * sq) / size)
        e = torch.where(det > 0, error(s, low - lo, sq, sqq, sqw), torch.inf)
        better = e < best
        best = torch.where(better, e, best)
        best_s, best_low = torch.where(better, s, best_s), torch.where(better, low, best_low)
    q = (g - (best_low - lo)[..., None]).div_(best_s[..., None]).round_().clamp_(0, 15)
    # the scores' sums lose the errors of near-exact groups to rounding: measured for the winner and the min/max
    # grid, weight by weight, the min/max grid stays wherever it is no worse
    fitted = (q * best_s[..., None]).add_((best_low - lo)[..., None]).sub_(g).square_().sum(dim=-1)
    q0 = q0.reshape(g.shape)
    plain = (q0 * scale0[..., None]).add_((low0 - lo)[..., None]).sub_(g).square_().sum(dim=-1)
    keep = (plain <= fitted)[..., None]
    q = torch.where(keep, q0, q.to(torch.uint8))
    return q.reshape(n, k), torch.where(keep[..., 0], scale0, best_s), torch.where(keep[..., 0], low0, best_low)


def quantize_int4_low(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The min/max grid, with each group's low end in place of its zero point: w ~ q * scale + low, the 16 levels
    spanning the group from its minimum rounded down to an fp16 value, with the scale rounded up, so every weight
    stays within scale / 2 of its level. QLoRA's base takes it as it is (one pass: a large model is quantized
    one layer at a time as it loads, where the one fp32 copy of `w`, the only temporary of its size, sets the
    peak); `quantize_int4` refines it."""
    n, k = w.shape
    groups = w.to(torch.float32, copy=True).reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    low = _fp16_toward(lo, down=True)
    scale = _fp16_toward(((hi - low) / 15).clamp(min=_TINY), down=False)
    q = groups.sub_(low[..., None]).div_(scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, low


def _fp16_nearest(x: torch.Tensor) -> torch.Tensor:
    """x (fp32) as the nearest fp16 value, in fp32; x itself where fp16 cannot hold it (beyond 65504)."""
    out = x.half().float()
    return torch.where(out.isfinite(), out, x)


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
