"""Matmul and loss kernels the model and its adapters run through, for CPUs as they are.

* `upcasting_linear`: F.linear, except for bf16/fp16 weights on a CPU without native low-precision matmuls (no
  AVX512-BF16 or AMX: AMD Zen 3, older Xeons), where torch's bf16 matmul is several times slower than fp32 (two
  orders of magnitude for an LM head's backward). There it computes in fp32, in chunks of the weight's rows, and rounds
  once: the numbers of a native bf16 matmul (fp32 accumulation, one rounding) at fp32 speed.
  And for an LM head whose vocabulary is not a multiple of 64 (GPT-2's 50,257) on a CPU, in fp32 or bf16: the
  CPU's matmuls at such an odd output width run markedly slower (nanoGPT pads its vocabulary to 50,304 for
  this); it runs the rows up to the last multiple of 64 as one product and the few left as another, each into
  its own columns of an output whose rows are padded to a multiple of 64 elements (the logits are a view of it:
  written at an odd row stride, GPT-2's head forward took 1.3x as long on a Zen 3; `padded_width`): the same
  numbers, no copy, at the aligned width's speed. The same holds for a GPU's tensor cores (a padded vocabulary
  trains GPT-2 faster: README, "On a GPU"); there the padding is `F.pad` of the weight, which torch.compile fuses
  into autocast's cast of it.
* `cross_entropy`: F.cross_entropy(logits.float(), targets, ignore_index=-1) without an fp32 copy of the whole
  (N, vocab) logits or a saved log-softmax: 400 MB each at 2,048 tokens x 49,152 words; in training one pass of
  exp over the logits, whose softmax is also the gradient (backward only scales it). On an x86 CPU, in training
  or for LM-head-sized logits, that pass is gptlab's C++ kernel (`gptlab.kernels`, cross_entropy.cpp): one read
  of each row instead of ~10 ATen ops per chunk of rows.
* `gelu`: F.gelu, except in training on an x86 CPU: either form, erf or tanh (GPT-2's), and its slope in one pass of
  gptlab's C++ kernel (activations.cpp), autograd keeping the slope, so that the backward is one product: ATen's
  backward evaluates the erf form's two exps again, and its tanh form runs a slow vectorized tanh.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F


@functools.cache
def native_low_precision_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively. Without AVX512-BF16 or AMX (AVX2-only CPUs such as
    AMD Zen 3) torch's bf16 matmul is several times slower than fp32, and two orders of magnitude slower with a
    long inner dimension (an LM head's backward)."""
    def has(feature: str) -> bool:  # torch's CPU feature probes (private: assume native if one is missing)
        return bool(getattr(torch.cpu, f"_is_{feature}_supported", lambda: True)())

    if dtype == torch.bfloat16:
        return has("avx512_bf16") or has("amx_tile")
    if dtype == torch.float16:
        return has("amx_fp16")
    return True


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` computes in fp32: low-precision tensors on a CPU without native matmuls."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and not native_low_precision_matmul(weight.dtype))


def _chunks(n: int, size: int) -> Iterator[slice]:
    return (slice(i, min(i + size, n)) for i in range(0, n, size))


def row_chunks(rows: int, cols: int, device: torch.device) -> Iterator[slice]:
    """Row ranges of a (rows, cols) matrix whose fp32 copies take 2 MB each on a CPU (about a core's L2 per
    thread of two: each chunk is read several times, so larger chunks fall out of the cache and run slower),
    256 MB on a GPU (where each chunk costs kernel launches)."""
    return _chunks(rows, max(1, (1 << (19 if device.type == "cpu" else 26)) // max(cols, 1)))


class _UpcastLinear(torch.autograd.Function):
    """F.linear on bf16/fp16 tensors computed in fp32, the result rounded to the input dtype: the same numbers as
    a native low-precision matmul (fp32 accumulation, one rounding), at fp32 speed. Saves what F.linear saves
    (x only when the weight trains). Runs over chunks of the weight's rows (an LM head's 49k), so no fp32 copy of
    the whole weight or output exists at once and each chunk of the weight is read once per pass."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.has_bias = bias is not None
        x2 = x.reshape(-1, x.shape[-1])
        out = x2.new_empty(x2.shape[0], weight.shape[0])
        with torch.autocast("cpu", enabled=False):
            x32 = x2.float()
            for cols in _chunks(weight.shape[0], _UpcastLinear.chunk(x2.shape[0])):
                b = None if bias is None else bias[cols].float()
                out[:, cols] = F.linear(x32, weight[cols].float(), b)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        gx32 = g2.new_zeros(g2.shape[0], weight.shape[1], dtype=torch.float32) if need_x else None
        gw = torch.empty_like(weight) if need_w else None
        gb = weight.new_empty(weight.shape[0]) if need_b else None
        with torch.autocast("cpu", enabled=False):
            x32 = x.reshape(-1, x.shape[-1]).float() if need_w else None
            for cols in _chunks(weight.shape[0], _UpcastLinear.chunk(g2.shape[0])):
                g = g2[:, cols].float()
                if need_x:
                    gx32.addmm_(g, weight[cols].float())
                if need_w:
                    gw[cols] = g.T @ x32
                if need_b:
                    gb[cols] = g.sum(0)
        gx = gx32.to(grad.dtype).view(*grad.shape[:-1], weight.shape[1]) if need_x else None
        return gx, gw, gb

    @staticmethod
    def chunk(rows: int) -> int:
        """Weight rows per chunk: fp32 (rows, chunk) blocks of the output or its gradient of about 32 MB."""
        return max(256, (1 << 23) // max(rows, 1))


class _SplitLinear(torch.autograd.Function):
    """F.linear for a wide weight of an odd number of rows (an LM head) on a CPU, as two products: the rows up to
    the last multiple of 64, then the few left, each written straight into its columns of the output (and rows
    of the weight's gradient). The CPU's GEMMs block their output by such multiples; at an odd width the whole
    product runs slower, the backward's weight gradient most (nanoGPT pads GPT-2's vocabulary to 50,304 for
    this). Every output element is the same dot product F.linear computes; no copy is made or saved."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, weight)
        ctx.has_bias = bias is not None
        return split_product(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2 @ weight).view(*grad.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        gw = split_weight_grad(g2, x2) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb

    @staticmethod
    def helps(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """A matrix-matrix product on a CPU with a wide weight (>= 4,096 rows) of a width not a multiple of 64, in
        the inputs' own dtype (autocast, which would cast inside, takes F.linear)."""
        return (weight.device.type == "cpu" and weight.dtype == x.dtype and x.dtype in _SPLIT_DTYPES
                and not torch.is_autocast_enabled("cpu") and _odd_wide_product(x, weight))


_SPLIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _split_rows(n: int) -> tuple[slice, slice]:
    """A wide weight's rows up to the last multiple of 64, and the few left."""
    return slice(0, n // 64 * 64), slice(n // 64 * 64, n)


def padded_width(n: int, itemsize: int) -> int:
    """The elements a row of n values takes in an LM head's logits on a CPU: n rounded up to a multiple of 64, so
    that every row of the GEMM's output starts aligned (at GPT-2's 50,257, MKL's fp32 head forward took 590-610 ms
    against 450 at 1,024 x 768 on a Zen 3), and 64 more where the rows would then lie a whole number of 4 KiB pages
    apart, which puts them in the same cache sets (SmolLM2's 49,152 fp32 logits at 1,024 x 576, alternating: the
    head's forward 358-365 ms against 337-346 at rows of 49,216, its weight gradient 343-346 against 306-314)."""
    width = -(-n // 64) * 64
    return width + 64 if width * itemsize % 4096 == 0 else width


def split_product(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (M, C) @ weight.T (+ bias) as `_SplitLinear`'s two products, each into its own columns of the output: an
    (M, V) view of rows `padded_width` apart."""
    n = weight.shape[0]
    out = x2.new_empty(x2.shape[0], padded_width(n, x2.element_size()))[:, :n]
    for rows in _split_rows(weight.shape[0]):  # with a bias, addmm as F.linear: one rounding of product + bias
        if bias is None:
            torch.mm(x2, weight[rows].T, out=out[:, rows])
        else:
            torch.addmm(bias[rows], x2, weight[rows].T, out=out[:, rows])
    return out


def split_weight_grad(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """g2.T @ x2, the weight's gradient (V, C) of `split_product`, as two products into its rows."""
    gw = g2.new_empty(g2.shape[1], x2.shape[1])
    for rows in _split_rows(g2.shape[1]):
        torch.mm(g2[:, rows].T, x2, out=gw[rows])
    return gw


def upcasting_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through fp32 where this CPU has no native matmul for the weights' low-precision dtype, and
    split at a multiple of 64 rows for a wide weight of an odd width on a CPU (see the module docstring)."""
    if upcasts(x, weight) and x.dtype == weight.dtype:
        return _UpcastLinear.apply(x, weight, bias)
    if _SplitLinear.helps(x, weight):
        return _SplitLinear.apply(x, weight, bias)
    if _gpu_pads(x, weight):
        return padded_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _odd_wide_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A wide weight (an LM head, >= 4,096 rows) of a width not a multiple of 64, in a matrix-matrix product (at
    least 64 rows of x): where an aligned width pays."""
    return bool(weight.shape[0] % 64 and weight.shape[0] >= 4096 and x.numel() >= 64 * x.shape[-1])


def _gpu_pads(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Such a product on a GPU, in any dtype (tensor cores want the aligned width)."""
    return weight.device.type == "cuda" and _odd_wide_product(x, weight)


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear at the output width rounded up to a multiple of 64 (zero rows below the weight), sliced back:
    the same numbers; autograd passes gradients through the pad and the slice."""
    n = weight.shape[0]
    pad = -(-n // 64) * 64 - n
    out = F.linear(x, F.pad(weight, (0, 0, 0, pad)), None if bias is None else F.pad(bias, (0, pad)))
    return out[..., :n]


class _CrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of (N, V) logits in any float dtype against (N,) targets (-1: ignored, loss 0),
    computed in fp32 over row chunks: no fp32 copy of the whole logits, no saved log-softmax (N x V fp32 each:
    400 MB apiece at 2,048 x 49,152).

    With `grad` the forward also makes the gradient: a chunk's softmax, computed once for its log-sum-exp, minus
    the targets' one-hot is d(loss_i)/d(logits_i), stored in the logits' dtype (the buffer backward would
    allocate for its result). Backward then only scales each row by its incoming gradient: no second pass of
    exp over the 50,257-wide rows. The stored softmax is rounded to the logits' dtype before that scaling (for
    bf16 two roundings instead of one: within bf16's own error). The forward is the C++ kernel where
    `_native_softmax_xent` has one, else ATen ops over row chunks (`_chunked_softmax_xent`)."""

    @staticmethod
    def forward(ctx, logits, targets, grad):  # noqa: ANN001, ANN205
        valid = targets != -1
        native = _native_softmax_xent(logits, grad)
        if native is not None:  # one pass per row in C++ (kernels/cross_entropy.cpp): the same sums, in fp32
            losses, softmax = native(logits, targets, grad)
        else:
            losses, softmax = _chunked_softmax_xent(logits, targets, valid, grad)
        ctx.save_for_backward(softmax if grad else None, valid)
        return losses

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        softmax, valid = ctx.saved_tensors
        if softmax is None:
            raise RuntimeError("cross_entropy was computed without its gradient (grad=False)")
        return logits_gradient(softmax, valid, grad), None, None


def logits_gradient(softmax: torch.Tensor, valid: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The logits' gradient from each row's softmax minus its one-hot (as `_CrossEntropy` keeps it) and the
    per-row losses' incoming gradient `grad`, zero on rows whose target is ignored (not `valid`), in the logits'
    dtype: each value computed in fp32 and rounded once."""
    if softmax.dtype != torch.float32 and grad.stride(0) == 0:  # one scale for every row (a sum or mean):
        return softmax * grad[0]  # computed in fp32, rounded once, as below; ignored rows are 0
    scale = torch.where(valid, grad.float(), 0.0)[:, None]
    if softmax.dtype == torch.float32:
        return softmax * scale
    out = torch.empty_like(softmax)  # scaled in fp32 chunk by chunk (mixed-dtype products run far slower)
    for rows in row_chunks(out.shape[0], out.shape[1], out.device):
        out[rows] = softmax[rows].float().mul_(scale[rows])
    return out


def _chunked_softmax_xent(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                          grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_CrossEntropy's forward in ATen ops over row chunks: each row's loss (0 where ignored) and, with `grad`, the
    rows' softmax minus the one-hot in the logits' dtype (zeros on ignored rows)."""
    n = logits.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    picked = torch.empty(n, dtype=torch.float32, device=logits.device)
    safe = targets.clamp(min=0)
    softmax = torch.empty_like(logits) if grad else None  # minus the one-hot: the per-row gradient
    for rows in row_chunks(n, logits.shape[1], logits.device):
        chunk = logits[rows]
        picked[rows] = chunk.gather(1, safe[rows, None])[:, 0].float()
        if softmax is None:
            lse[rows] = torch.logsumexp(chunk.float(), dim=-1)
            continue
        # the row maxima (exact in any dtype), then exp(logits - max) in fp32, in place on one fp32 copy (a
        # subtraction of mixed dtypes runs ~30x slower on a CPU)
        peak = chunk.amax(dim=-1, keepdim=True).float().clamp_(min=torch.finfo(torch.float32).min)
        shifted = chunk.to(torch.float32, copy=True).sub_(peak).exp_()
        total = shifted.sum(dim=-1, keepdim=True)
        lse[rows] = (total.log() + peak)[:, 0]
        shifted.mul_(total.reciprocal_().mul_(valid[rows, None])).scatter_add_(1, safe[rows, None],
                                                                             -valid[rows, None].float())
        softmax[rows] = shifted
    return torch.where(valid, lse - picked, 0.0), softmax


def _native_softmax_xent(logits: torch.Tensor, training: bool):  # noqa: ANN202 - the op, or None
    """gptlab's C++ cross-entropy (`gptlab.kernels`, built once per machine) for fp32/bf16 logits on an x86 CPU, or
    None. In training whatever their size: one op instead of ~12 (a character model's step is mostly such
    per-op costs; its attention has loaded the library already, `gptlab.heads`). Outside training only for
    LM-head-sized logits: for small ones the chunked ATen ops cost less than loading the library. Under
    torch.compile inductor fuses those instead."""
    if (logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16)
            or (logits.numel() < _NATIVE_XENT_MIN and not training) or not rows_contiguous(logits)
            or torch.compiler.is_compiling()):
        return None
    from gptlab.kernels import widest_ops

    ops = widest_ops()
    return None if ops is None else ops.softmax_xent


def rows_contiguous(x: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are each contiguous and do not overlap (`split_product`'s padded logits among them)."""
    return x.dim() == 2 and (x.shape[1] <= 1 or x.stride(1) == 1) and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1])


_NATIVE_XENT_MIN = 1 << 22  # logits' elements: 4M, e.g. 1,024 tokens over a 4,096-word vocabulary


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(logits.float(), targets, ignore_index=-1, reduction=reduction) over (N, V) logits, in less
    memory (see _CrossEntropy); "mean" is over the targets that are not -1 (NaN when there are none)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    targets = targets.long()
    if logits.device.type == "cuda" and torch.compiler.is_compiling():
        # compiled on a GPU, inductor fuses this into passes over the logits that hold no fp32 copy of them: far
        # fewer bytes than the chunks below, which are for a CPU's memory
        return F.cross_entropy(logits.float(), targets, ignore_index=-1, reduction=reduction)
    losses = _CrossEntropy.apply(logits, targets, logits.requires_grad and torch.is_grad_enabled())
    return reduce_losses(losses, targets, reduction)


def reduce_losses(losses: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-target losses (0 where the target is -1) as `cross_entropy`'s `reduction` asks: "none", "sum", or the
    mean over the targets that are not -1."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != -1).sum()


class _Gelu(torch.autograd.Function):
    """F.gelu(x, approximate) through the C++ kernel `ops`: the forward computes the slope dy/dx with the value and
    keeps it in x's place, the backward multiplies by it (within fp32 rounding of ATen's values; a bf16 slope is
    rounded once more before that product)."""

    @staticmethod
    def forward(ctx, x, approximate, ops):  # noqa: ANN001, ANN205
        y, slope = ops.gelu_with_slope(x, approximate == "tanh")
        ctx.save_for_backward(slope)
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu; in training (x needs a gradient) on an x86 CPU through gptlab's kernel, whose gain is the backward's
    (inference, scoring passes included, keeps ATen's bits, which the HF parity tests and the decode steps follow;
    torch.compile fuses ATen's)."""
    if x.numel() < _NATIVE_GELU_MIN or not x.is_contiguous():
        return F.gelu(x, approximate=approximate)
    from gptlab.kernels import gradient_wanted, training_ops

    ops = training_ops(x) if gradient_wanted(x) else None
    return F.gelu(x, approximate=approximate) if ops is None else _Gelu.apply(x, approximate, ops)


# elements below which a call's cost is mostly its overhead either way (through autograd, forward and backward of
# 4k elements: 0.09 ms through the kernel, 0.12 through ATen's; 16k: 0.12 and 0.13 ms)
_NATIVE_GELU_MIN = 1 << 14


def assert_in_range_on_device(t: torch.Tensor, low: int, high: int, message: str) -> bool:
    """On a CUDA tensor: queue a device-side assertion that every value is in [low, high) and return True (the
    caller then reads nothing back: the check costs no host sync; a failure stops the process with `message`
    when the GPU gets there). On any other device False: the caller checks on the host, with a ValueError."""
    if t.device.type != "cuda":
        return False
    lo, hi = torch.aminmax(t)
    torch._assert_async((lo >= low) & (hi < high), message)
    return True


def check_targets_like(idx: torch.Tensor, targets: torch.Tensor) -> None:
    """A ValueError unless targets are integer ids shaped as idx (read from the tensors' metadata, nothing from the
    device): the loss would otherwise fail as "softmax_xent: targets must be (N,) int64", pair a reshaped target
    with the wrong position, or truncate float targets without a word."""
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    if targets.shape != idx.shape:
        raise ValueError(f"targets must have the token ids' shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
