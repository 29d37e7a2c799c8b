"""The model's LayerNorm and RMSNorm: torch's modules, whose forward in training on a CPU runs one C++ kernel.

ATen's norms take ~70 us forward and ~110 us backward at a small model's bf16 rows (2,048 x 64), and its RMSNorm is a
composite of ~5 ops each way at any width; gptlab's (`gptlab.kernels`, norms.cpp) make one pass per row each way,
within fp32 rounding of ATen's values (tests/test_norms.py checks values and gradients against the maths in
fp64). The modules are nn.LayerNorm / nn.RMSNorm (same parameters, state-dict names and checks); only the forward
differs, and only where the kernel is used: training (a gradient is wanted), a CPU, fp32 or bf16 rows, outside
torch.compile. Inference keeps ATen's bits, which the Hugging Face parity tests and the decode steps follow.
Gemma's RMSNorm, scaled by (1 + weight), is a module of its own; `make_norm` builds the one a config names.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.config import GPTConfig


class _NormRows(torch.autograd.Function):
    """LayerNorm / RMSNorm of x's rows through the kernel `ops`; backward from the rows' saved statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, ops):  # noqa: ANN001, ANN205
        y, mean, rstd = ops.norm_rows(x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.ops, ctx.has_bias = rms, ops, bias is not None
        ctx.param_dtype = weight.dtype if weight is not None else bias.dtype if bias is not None else x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight, mean, rstd = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        bias_grad = ctx.has_bias and ctx.needs_input_grad[2]
        dx, dw, db = ctx.ops.norm_rows_backward(grad, x, weight, mean, rstd, ctx.rms, weight_grad, bias_grad,
                                                ctx.param_dtype)
        return dx, dw if weight_grad else None, db if bias_grad else None, None, None, None


def _kernel(x: torch.Tensor, *params: torch.Tensor | None):  # noqa: ANN202 - the ops, or None
    """gptlab's kernel library where it runs these rows: in training on a CPU (`training_ops`), contiguous rows, the
    parameters fp32 or x's dtype."""
    if not x.is_contiguous() or any(p is not None and p.dtype not in (torch.float32, x.dtype) for p in params):
        return None
    from gptlab.kernels import training_ops

    return training_ops(x, *params)


_ATEN_FP32_WIDTH = 256  # fp32 LayerNorm rows this wide or wider keep ATen's kernel (see layer_norm)


def layer_norm(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm; over the last dim in training on a CPU, gptlab's kernel (but for fp32 rows of 256 values or
    more, where ATen's fused fp32 LayerNorm is the faster: 0.20 / 0.33 against 0.24 / 0.38 ms forward / backward at
    1,024 x 768 on an AVX-512 Xeon; in bf16 the kernel is 1.3x / 2x faster there, and at 64 wide in either)."""
    wide_fp32 = x.dtype == torch.float32 and x.shape[-1] >= _ATEN_FP32_WIDTH
    ops = _kernel(x, weight, bias) if len(normalized_shape) == 1 and not wide_fp32 else None
    if ops is None:
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    return _NormRows.apply(x, weight, bias, eps, False, ops)


def rms_norm(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """F.rms_norm; over the last dim in training on a CPU, gptlab's kernel (eps None: x's dtype's eps, as F's).
    ATen's is a composite of ~5 ops each way: the kernel's forward and backward take 4-7x less (1,024 x 768 fp32:
    0.96 against 4.7 ms)."""
    ops = _kernel(x, weight) if len(normalized_shape) == 1 else None
    if ops is None:
        return F.rms_norm(x, normalized_shape, weight, eps)
    return _NormRows.apply(x, weight, None, torch.finfo(x.dtype).eps if eps is None else eps, True, ops)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm through `layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm through `rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class UnitOffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in fp32, the weight starting at 0 (Gemma)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: GPTConfig) -> nn.Module:
    """The norm the config names, as the blocks and the final norm use it."""
    if config.norm_unit_offset:
        return UnitOffsetRMSNorm(config.n_embd, config.norm_eps)
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps, elementwise_affine=config.norm_weight)
    return LayerNorm(config.n_embd, eps=config.norm_eps, elementwise_affine=config.norm_weight,
                     bias=config.has_bias("norm"))
