"""The model's Linear layers: torch's nn.Linear, whose products in training on a CPU run in the orientation this
machine computes faster.

A product C = A @ B can also be computed as C^T = B^T @ A^T and transposed back. The CPU's GEMMs (oneDNN for bf16,
MKL for fp32) block and partition each orientation differently, and which one is faster depends on the shape and the
CPU: on a 2-core AMX Xeon, GPT-2's bf16 products with 768 outputs over 2,304-3,072 inputs (the MLP's down projection,
the gradients of the MLP's and the attention's inputs) run at ~0.85 TFLOP/s as written and ~1.5 transposed, copy
included, while its other products run fastest as written. So each product of a training step (the forward, the
input's gradient, the weight's gradient) at a shape large enough to matter runs in the orientation measured faster
on this machine, once per machine (cached in `products.json` beside `hardware.json`, so that a resumed run takes the
same path and gets the same bits). The weight's gradient is made in the weight's own layout: no transposing copy of
it before it is accumulated, as torch's autograd of F.linear makes.

Only the forward differs from nn.Linear, and only in training (a gradient wanted) on a CPU in fp32 or bf16, outside
autocast and torch.compile; both orientations compute the same dot products (tests/test_linear.py: values and
gradients against F.linear). Inference keeps F.linear's bits, which the Hugging Face parity tests and the decode
steps follow.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# multiply-adds below which a product runs as written: a probe would cost more than the choice saves (a character
# model's 64-wide products, ~0.1 ms)
_MIN_PRODUCT = 1 << 27

_VERSION = "v2"  # of how a transposed product is laid back (a new one measures again): gptlab's transpose
_chosen: dict[str, bool] = {}  # this process's choices, by key: True where the transposed product is faster


class Linear(nn.Linear):
    """nn.Linear through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def plain_linear(module: nn.Module) -> bool:
    """Exactly nn.Linear or gptlab's Linear (whose forward is the product and nothing more): what quantization and
    inference packing replace. A subclass such as LoRA's does more."""
    return type(module) in (nn.Linear, Linear)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; in training on a CPU, each product in the orientation measured faster here (module docstring).
    Products too small to matter keep F.linear (an autograd Function's Python costs ~50 us a call)."""
    if x.numel() * weight.shape[0] < _MIN_PRODUCT or not _oriented(x, weight):
        return F.linear(x, weight, bias)
    return _OrientedLinear.apply(x, weight, bias)


def _oriented(x: torch.Tensor, weight: torch.Tensor) -> bool:
    from gptlab.kernels import takes_training_kernels  # the kernels' gate; the orientation needs no kernel built

    return (x.dtype == weight.dtype and x.dim() >= 2 and not torch.is_autocast_enabled("cpu")
            and takes_training_kernels(x, weight))


class _OrientedLinear(torch.autograd.Function):
    """x @ weight.T + bias with each of its three products through `product`."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        y = product(x2, weight.t(), "forward", bias)  # (M, N)
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, weight)
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # (M, N)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = product(g2, weight, "input").view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            gw = product(g2.t(), x2, "weight")  # (N, K): the weight's layout
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def product(a: torch.Tensor, b: torch.Tensor, role: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (+ bias over its columns), a contiguous (M, N) result, computed as written or as (b.T @ a.T).T,
    whichever this machine runs faster at these shapes and layouts (`transposed_is_faster`)."""
    if transposed_is_faster(a, b, role):
        return _transposed(a, b, bias)
    return _as_written(a, b, bias)


def _as_written(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return a @ b if bias is None else torch.addmm(bias, a, b)


def _transposed(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # (N, M) in one product (the bias added down its columns in the same rounding), laid out (M, N) in one copy:
    # gptlab's blocked transpose where its kernels run (PyTorch's copy of a transposed bf16 view is ~2x slower)
    out_t = b.t() @ a.t() if bias is None else torch.addmm(bias[:, None], b.t(), a.t())
    from gptlab.kernels import widest_ops

    ops = widest_ops() if out_t.dtype in (torch.float32, torch.bfloat16) else None
    return out_t.t().contiguous() if ops is None else ops.transpose_copy(out_t)


def transposed_is_faster(a: torch.Tensor, b: torch.Tensor, role: str) -> bool:
    """Whether (b.T @ a.T).T runs faster here than a @ b for operands of these shapes, layouts and dtype: False
    for products too small to matter; else measured once per machine (`products.json`) and remembered."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if m * k * n < _MIN_PRODUCT:
        return False
    layout = "".join("t" if t.stride(0) == 1 and t.shape[1] > 1 else "n" for t in (a, b))
    key = f"{role}|{m}x{k}x{n}|{layout}|{str(a.dtype).removeprefix('torch.')}|threads={torch.get_num_threads()}"
    if key not in _chosen:
        _chosen[key] = _measured(key, a, b)
    return _chosen[key]


def _measured(key: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    from gptlab.hardware import busy, cached_measurement, cpu_id

    def read(entry: object) -> bool | None:
        return entry if isinstance(entry, bool) else None

    def measure() -> bool:
        with torch.no_grad():
            written, transposed = _seconds(lambda: _as_written(a, b, None)), _seconds(lambda: _transposed(a, b, None))
        return transposed < 0.9 * written  # a clear margin: on a tie the product stays as written

    return cached_measurement("products.json", f"{cpu_id()}|torch={torch.__version__}|{_VERSION}|{key}", read,
                              measure, is_busy=busy)


def _seconds(run, calls: int = 3) -> float:  # noqa: ANN001 - a () -> Tensor
    """The fastest of `calls` runs, after one to warm up (the GEMM's first call picks and packs)."""
    run()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best
