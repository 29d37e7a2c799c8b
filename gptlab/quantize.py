"""Weight-only quantization for inference: int8 per output channel, int4 in groups along the input dimension.

Decoding one token reads every weight once and does little arithmetic with it, so its speed is set by how many
bytes of weights it reads: int8 halves a bf16 model's, int4 quarters it. The activations are not stored
quantized (gptlab's kernel below rounds them inside the product: int8 to 16-bit fixed point, int4 to int8 blocks).

* Which layers: every Linear in the blocks (attention's q/k/v and output projections, the MLP's two) and the LM
  head. The head is GPT-2's largest matrix (38.6M of its 124M parameters, a third of the bytes read per token),
  and llama.cpp quantizes it too. The embedding tables stay as they are: a lookup reads one row per token, so
  quantizing them saves nothing per token. A tied head (GPT-2 shares `wte` with it) gets its own integer copy;
  the `nn.Embedding` keeps the original Parameter, so lookups are unchanged.
* int8: symmetric, one scale per output row: scale = max|w| / 127, q = round(w / scale) in [-127, 127],
  w ~ q * scale.
* int4: asymmetric, one scale and one zero point per `group_size` consecutive inputs of a row (the layout of
  PyTorch's int4 kernels): scale = (max - min) / 15, q = round((w - min) / scale) in [0, 15], w ~ (q - 8) *
  scale + zero with zero = min + 8 * scale (= q * scale + min). A zero point spends the 16 levels on the range
  the group actually has, where a symmetric grid wastes part of it on the side with the smaller magnitude.
  Group size 32 by default: the most accurate of the kernels' sizes, and at batch 1 about as fast as 64 or 128
  (at batch 32 larger groups are faster: benchmarks/kernel_throughput.py).

Both round to the nearest level, so |w - dequantized w| <= scale / 2 for every element (tests check this).

`QuantizedLinear` holds the integers and scales as buffers (they move with `.to(device)`; `state_dict` holds
them) and computes x @ dequantized(W).T + b. `reference` does exactly that in PyTorch; `forward` calls a faster
kernel where one runs:

* CPUs where it is the faster path (measured once per machine by `gptlab.kernels.dispatch`: so far every x86 CPU
  tried, AVX2-only and AVX-512 alike): gptlab's own kernel (`gptlab.kernels`, built once per machine). int8: integer
  multiply-adds against the activations put in 16-bit fixed point per row (rounding error at most 2^-16 of the
  row's largest value: finer than the bf16 activations PyTorch's kernels take, for every value above 1/128 of the
  largest). int4: byte dot products against the activations rounded to int8 per block of 32 inputs, as llama.cpp's
  q4_0 x q8_0 (error at most 1/254 of the block's largest value; four products per instruction, not two). Both sum
  exactly in int32 and scale in fp32.
  PyTorch's kernels below were slower there than the bf16 model; benchmarks/generate_throughput.py --settings
  1:int8,1:int4 times this kernel against them.
* Elsewhere on CPUs: PyTorch's `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu`, with bf16 (or fp16)
  activations and scales. With fp32 activations these kernels are several times slower than with bf16, so an fp32
  model's activations go through them in bf16 and come back in fp32: the same rounding a bf16 matmul has.
  Dequantizing and then multiplying is several times slower than either kernel, so it is only the reference.
* CUDA (quantized on the CPU, only the integers moved: `gptlab.loading`): int4 through `aten._weight_int4pack_mm`
  (tinygemm), checked once against the reference on a small weight before use; int8 as (x @ q.T) * scale with
  each layer's weight widened for its call only (the integers stay the one copy at rest). `aten._weight_int8pack_mm`
  was several times slower than that at batch 1 on a GPU (benchmarks/gpu.py decode times both; README has the
  figures).
* Anywhere else (another device, float64 inputs, a kernel that refuses a shape): the reference.

The kernels' copies of the weights (packed layouts, scales in the activations' dtype) are made on first use per
device and dtype and kept beside the buffers, not in `state_dict`; `.to()` and `load_state_dict` drop them. No
kernel has a backward: an input's gradient goes through the dequantized weight (`_InputGradient`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.errors import GptlabError
from gptlab.integer_weights import (
    dequantize_int4,
    dequantize_int8,
    int4_params_fit_fp16,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)
from gptlab.kernels.dispatch import SMALL_BATCH, chosen_ops
from gptlab.linear import plain_linear
from gptlab.lora import has_lora

log = logging.getLogger(__name__)

Mode = Literal["int8", "int4"]
MODES: tuple[str, ...] = ("int8", "int4")
GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)  # what PyTorch's int4 kernels take
DEFAULT_GROUP_SIZE = 32
# PyTorch's CPU int8 kernel reads the input width in blocks of 16 with no tail: at other widths it returns garbage
# or crashes (torch 2.13: K = 24, 40, 264 wrong, K = 8, 33, 56 SIGSEGV), so the weight and x are padded to it (on
# every device: the same op, and the padding costs nothing at the usual widths)
_INT8_K_MULTIPLE = 16


# ---------------------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------------------
class QuantizedLinear(nn.Module):
    """A Linear layer's weight as int8 (per output row) or int4 (per group of inputs), computed with the
    dequantized weight; see the module docstring. Not an `nn.Linear`: the packed bf16/fp32 inference weights
    (`generation.packed_linear`) and anything else that takes a Linear's `weight` leave it alone."""

    def __init__(self, linear: nn.Linear, mode: Mode, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.mode, self.group_size = mode, group_size if mode == "int4" else 0
        self._store(linear.weight.detach())
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._runs: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}  # input's kind -> its forward
        # PyTorch's kernel with its copy of the weights, per (device, compute dtype): shared by every row count
        # (a packed int4 copy is as large as the integers themselves)
        self._matmuls: dict[tuple, Callable[[torch.Tensor], torch.Tensor] | None] = {}
        # gptlab's kernel's copy of the weights (every build reads the one layout); None: not made yet, False:
        # these weights do not fit it
        self._kernel: tuple[torch.Tensor, torch.Tensor] | bool | None = None

    def _store(self, w: torch.Tensor) -> None:
        """The weight's integers and their scales as buffers."""
        # contiguous whatever the weight's layout (a transposed view keeps its strides through the arithmetic): the
        # kernels read the buffers as dense row-major
        if self.mode == "int8":
            q, scale = quantize_int8(w)
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("scale", scale.contiguous())
        else:
            q, scale, zero = quantize_int4(w, self.group_size)
            self.register_buffer("qweight", pack_nibbles(q).contiguous())
            self.register_buffer("scale", scale.contiguous())
            self.register_buffer("zero", zero.contiguous())

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.mode}{group}"

    def dequantize(self) -> torch.Tensor:
        """The weight this layer computes with, (out, in) in fp32."""
        if self.mode == "int8":
            return dequantize_int8(self.qweight, self.scale)
        return dequantize_int4(unpack_nibbles(self.qweight), self.scale, self.zero)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dequantize().T + bias in x's dtype (under autocast, in autocast's): the plain path every kernel is
        tested against."""
        return F.linear(x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decoding calls each layer once per token: what to run for this kind of input is worked out once (a
        # batch of many rows apart from a few: the dispatch may pick another kernel for each)
        autocast = torch.is_autocast_enabled(x.device.type)
        rows = x.numel() // self.in_features if self.in_features else 1
        key = (x.device, x.dtype, autocast, rows >= SMALL_BATCH)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = self._prepare(x.device, x.dtype, autocast, rows)
        if x.requires_grad and torch.is_grad_enabled():  # the kernels have no backward of their own
            return _InputGradient.apply(x, run, self)
        return run(x)

    def forget_kernels(self) -> None:
        """Drop the kernels' copies of the weights; done on `.to()` and `load_state_dict`, needed after any other
        write to the buffers."""
        self._runs.clear()
        self._matmuls.clear()
        self._kernel = None

    def kernel(self, rows: int = 1) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None:
        """The build of gptlab's own kernel that runs this layer for inputs of about `rows` rows (its torch.ops
        namespace) and the weights in its layout, (packed integers, qparams) (see gptlab/kernels/linear_avx2.cpp),
        made once for every build: where the layer is on a CPU on which that kernel is the faster path for this
        mode and batch (`gptlab.kernels.dispatch`); None elsewhere (and for int8 weights of an odd input width,
        which its column pairs do not fit)."""
        ops = chosen_ops(self.mode, rows) if self.qweight.device.type == "cpu" else None
        if ops is None or self._kernel is False:
            return None
        if self._kernel is None:  # made for this device and these buffers (`forget_kernels` drops it)
            if (self.mode == "int8" and self.in_features % 2) or (
                    self.mode == "int4" and not int4_params_fit_fp16(self.scale, self.zero)):
                self._kernel = False  # int4 weights beyond fp16's range, or quantized elsewhere: PyTorch's kernel
                return None
            if self.mode == "int8":
                self._kernel = ops.pack_int8(self.qweight), self.scale.float().contiguous()
            else:
                self._kernel = tuple(ops.pack_int4(unpack_nibbles(self.qweight), self.scale, self.zero))
        return ops, self._kernel

    def kernel_name(self, dtype: torch.dtype = torch.bfloat16, rows: int = 1) -> str:
        """Which kernel runs this layer's forward for inputs of `dtype` and about `rows` rows on its device."""
        kernel = self.kernel(rows) if self.qweight.device.type == "cpu" else None
        if kernel is not None and dtype in (torch.float32, torch.bfloat16):
            return f"{kernel[0].name} ({self.mode})"
        make = _kernel_for(self.mode, self.qweight.device)
        return f"torch {self.mode} kernel" if make is not None else f"dequantize + F.linear ({self.mode})"

    def __getstate__(self) -> dict:
        """Copies and pickles leave the kernels' copies behind (made again on first use; a kernel build is no
        object to copy)."""
        return {**self.__dict__, "_runs": {}, "_matmuls": {}, "_kernel": None}

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's: .to(), .cuda(), .half(), ...
        self.forget_kernels()
        # scales and zero points move but keep their dtype: in a bf16 model's, every weight would move
        kept = {name: t for name, t in self._buffers.items() if t is not None and t.is_floating_point()}
        out = super()._apply(fn, recurse)
        for name, before in kept.items():
            if self._buffers[name].dtype != before.dtype:
                self._buffers[name] = before.to(self._buffers[name].device)
        return out

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.forget_kernels()
        super()._load_from_state_dict(*args, **kwargs)

    def _prepare(self, device: torch.device, dtype: torch.dtype, autocast: bool, rows: int):  # noqa: ANN202
        """The forward for inputs of this device, dtype, autocast state and about this many rows: a kernel with
        its copies of the weights where one works here, else the reference."""
        out_dtype = torch.get_autocast_dtype(device.type) if autocast else dtype
        own = device.type == "cpu" and out_dtype in (torch.float32, torch.bfloat16)
        kernel = self.kernel(rows) if own else None
        if kernel is not None:
            return functools.partial(_kernel_cpu, *kernel, None if self.bias is None else self.bias.detach().float(),
                                     self.out_features, out_dtype)
        if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return self.reference  # float64 and the like (see the module docstring)
        compute = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16  # see the docstring
        if (device, compute) not in self._matmuls:
            self._matmuls[(device, compute)] = self._pytorch_matmul(device, compute)
        matmul = self._matmuls[(device, compute)]
        if matmul is None:
            return self.reference
        bias = None if self.bias is None else self.bias.detach().to(compute)
        k, n = self.in_features, self.out_features

        def run(x: torch.Tensor) -> torch.Tensor:
            y = matmul(x.reshape(-1, k).to(compute).contiguous())  # PyTorch's kernels take dense rows only
            if bias is not None:
                y += bias
            return y.view(*x.shape[:-1], n).to(out_dtype)

        return run

    def _pytorch_matmul(self, device: torch.device, compute: torch.dtype):  # noqa: ANN202
        """PyTorch's kernel for this mode on `device` with its copy of the weights, x (M, K) -> (M, N) in
        `compute`; None where none works here (the reference runs)."""
        make = _kernel_for(self.mode, device)
        try:
            return None if make is None else make(self, compute)
        except (RuntimeError, NotImplementedError) as e:  # a shape or build the kernel refuses: the plain path
            log.debug("%s kernel refused a %s weight: %s", self.mode, (self.out_features, self.in_features), e)
            return None


class _InputGradient(torch.autograd.Function):
    """A kernel's forward, and the input's gradient grad @ W (W dequantized again: nothing saved); the integers
    are not trained, but a loss still reaches what lies before the layer (embeddings, earlier adapters)."""

    @staticmethod
    def forward(ctx, x, run, layer):  # noqa: ANN001, ANN205
        ctx.layer, ctx.dtype = layer, x.dtype
        return run(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        weight = ctx.layer.dequantize().to(grad.device)
        return (grad.float() @ weight).to(ctx.dtype), None, None


def _kernel_cpu(ops: Any, weights: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None, n: int,
                dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T + bias through gptlab's own kernel, in `dtype` (x's own, or autocast's)."""
    packed, qparams = weights
    return ops.linear(x.to(dtype), packed, qparams, bias, n)


# --- PyTorch's kernels: each takes (layer, activations' dtype) and returns x (M, K) -> y (M, N) --------------------
def _int8_weight_only(layer: QuantizedLinear, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """aten._weight_int8pack_mm: the integers times the activations, scaled per output channel (CPUs)."""
    q, scale = layer.qweight, layer.scale.to(dtype)
    pad = -layer.in_features % _INT8_K_MULTIPLE
    if pad:  # zero columns of the weight times zeros of x: the same sums
        q = F.pad(q, (0, pad))
        return lambda x: torch.ops.aten._weight_int8pack_mm(F.pad(x, (0, pad)), q, scale)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)


def _scales_and_zeros(layer: QuantizedLinear, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """(K / group_size, rows, 2) [scale, zero] pairs: the int4 kernels' layout (rows past out_features: padding)."""
    pairs = torch.stack([layer.scale, layer.zero], dim=-1)  # (N, K / g, 2)
    pairs = F.pad(pairs, (0, 0, 0, 0, 0, rows - layer.out_features))
    return pairs.transpose(0, 1).contiguous().to(dtype)


def _unpadded(y: torch.Tensor, n: int) -> torch.Tensor:
    return y if y.shape[1] == n else y[:, :n]


def _int4_cpu(layer: QuantizedLinear, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    n, g = layer.out_features, layer.group_size
    rows = n + (-n) % 16  # the CPU packing takes N in multiples of 16 (GPT-2's head has 50257 rows)
    q = F.pad(unpack_nibbles(layer.qweight).to(torch.int32), (0, 0, 0, rows - n))
    packed, pairs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), _scales_and_zeros(layer, dtype, rows)
    return lambda x: _unpadded(torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, pairs), n)


# --- CUDA kernels --------------------------------------------------------------------------------------------------
def _int8_widened(layer: QuantizedLinear, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """(x @ q.T) * scale: each call widens the layer's integers for the matmul and drops them, so they stay the
    only copy at rest."""
    q, scale = layer.qweight, layer.scale.to(dtype)
    return lambda x: (x @ q.T.to(dtype)) * scale


def _int4_cuda(layer: QuantizedLinear, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    n, g = layer.out_features, layer.group_size
    rows = n + (-n) % 8
    k_tiles = next(t for t in (8, 4, 2) if layer.in_features % (t * 16) == 0)
    q = F.pad(layer.qweight, (0, 0, 0, rows - n))
    packed = torch.ops.aten._convert_weight_to_int4pack(q, k_tiles)
    pairs = _scales_and_zeros(layer, torch.bfloat16, rows)  # tinygemm takes bf16 only
    return lambda x: _unpadded(torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), packed, g, pairs), n).to(dtype)


# per device and mode, the kernels to try, in order of preference: the first that works here runs
_KERNELS = {("cpu", "int8"): (_int8_weight_only,), ("cpu", "int4"): (_int4_cpu,),
            ("cuda", "int8"): (_int8_widened,), ("cuda", "int4"): (_int4_cuda,)}


def _kernel_for(mode: str, device: torch.device):  # noqa: ANN202 - one of the kernels above, or None
    return _working_kernel(mode, device.type) if (device.type, mode) in _KERNELS else None


@functools.cache
def _working_kernel(mode: str, device_type: str):  # noqa: ANN202 - one of the kernels above, or None
    """The first of `_KERNELS`' candidates that this build and device run with the reference's numbers (None: the
    reference runs), each tried once on a small weight (an op may be missing, refuse the device, or lay the
    weights out otherwise than this module assumes)."""
    return next((make for make in _KERNELS[(device_type, mode)] if _agrees(make, mode, device_type)), None)


def _agrees(make: Callable, mode: str, device_type: str) -> bool:
    """Whether kernel `make` runs here and gets the reference's numbers on a small weight."""
    try:
        gen = torch.Generator().manual_seed(0)  # not the global generator: a seeded sampler's draws stay as they are
        linear = nn.utils.skip_init(nn.Linear, 256, 40, bias=False)  # 40 rows: padded by both int4 packings
        linear.weight.data = torch.randn(40, 256, generator=gen)
        layer = QuantizedLinear(linear, mode, 32).to(device_type)
        layer.qweight.copy_(torch.randint(-127 if mode == "int8" else 0, 128 if mode == "int8" else 256,
                                          layer.qweight.shape, generator=gen).to(layer.qweight))
        x = torch.randn(3, 256, generator=gen).to(device_type, torch.bfloat16)
        with torch.autocast(device_type, enabled=False):  # the first call may come under a caller's autocast
            got, want = make(layer, torch.bfloat16)(x).float(), layer.reference(x.float()).float()
    except (RuntimeError, NotImplementedError) as e:
        log.debug("no %s %s kernel %s here: %s", device_type, mode, make.__name__, e)
        return False
    close = got.shape == want.shape and torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    if not close:
        log.warning("the %s %s kernel %s disagrees with the reference: not using it", device_type, mode,
                    make.__name__)
    return close


# ---------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------
def check_options(mode: str | None, group_size: int | None) -> None:
    """A mode and group size that make sense together (before anything is loaded)."""
    if mode is None:
        if group_size is not None:
            raise GptlabError("a group size only applies to int4 quantization: add --quantize int4")
        return
    if mode not in MODES:
        raise GptlabError(f"quantize must be one of {', '.join(MODES)}, got {mode!r}")
    if group_size is not None and mode != "int4":
        raise GptlabError(f"int8 quantization is per output channel and takes no group size (got {group_size}): "
                          "drop it, or quantize to int4")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise GptlabError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")


def quantize_model(model: nn.Module, mode: Mode, group_size: int | None = None) -> nn.Module:
    """Replace the model's Linear layers (blocks and LM head) by `QuantizedLinear`s in place; returns the model.

    For inference: the model must be in eval mode, without unmerged LoRA adapters, not quantized already. int4
    needs `group_size` (default 32) to divide every layer's input width."""
    check_options(mode, group_size)
    group_size = DEFAULT_GROUP_SIZE if mode == "int4" and group_size is None else group_size
    if model.training:
        raise GptlabError("cannot quantize a model in training mode: weight-only quantization is for inference "
                          "(call model.eval() first)")
    if has_lora(model):
        raise GptlabError("cannot quantize a model with unmerged LoRA adapters: merge them first (load it with "
                          "the adapters merged, the default)")
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise GptlabError("the model is quantized already")
    targets = [(name, m) for name, m in model.named_modules() if plain_linear(m)]
    if mode == "int4":
        for name, m in targets:
            if m.in_features % group_size:
                raise GptlabError(f"group size {group_size} does not divide {name}'s input width "
                                  f"{m.in_features}: choose one of {group_sizes_dividing(m.in_features)}")
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        with torch.no_grad():
            setattr(model.get_submodule(parent_name), attr, QuantizedLinear(m, mode, group_size or 0))
    return model


def group_sizes_dividing(width: int) -> str:
    """The int4 group sizes that divide an input width, as an error message offers them."""
    sizes = [str(g) for g in GROUP_SIZES if width % g == 0]
    return ", ".join(sizes) if sizes else "none (quantize to int8 instead)"
