"""QLoRA's frozen base (Dettmers et al. 2023): a pretrained model's block Linears stored as int8 or int4 (gptlab's
own formats, `quantize`'s arithmetic, not NF4), LoRA adapters trained over them.

What a quantized layer keeps, and nothing more: int4 as two weights a byte with an fp16 scale and an fp16 low end
per group of inputs (w = q * scale + low, 0.625 bytes a weight at groups of 32; the min/max grid of
`quantize_int4_low`, one pass as a model loads, where inference's `quantize_int4` refits each group; both fp16
values, so fp16 holds them exactly: fp32 only for weights beyond fp16's range), int8 as a byte a weight with an
fp32 scale per row. No fp32 copy of the base exists at any point: loading quantizes one layer as it is read
(`loading.load_frozen_base`), and each call dequantizes its layer's weight into the compute dtype a block at a time
(through fp32, rounded once, as casting the fp32 dequantized weight would), multiplies with the block and goes on
to the next in the same buffer: `_DequantizedLinear` saves nothing for backward and dequantizes again there. So no
layer's whole weight exists in the compute dtype, forward or backward: a large model's widest Linear (a gated MLP's
fused gate and up projection) would otherwise be the largest tensor of the step. Evaluation and rollouts run the
same function (no inference kernel's packed copy, which would double the base's bytes).

The embeddings, norms and LM head stay in the compute dtype, as QLoRA and peft keep them: a lookup reads one row
per token, and a tied head (GPT-2's) is the embedding's own table, which a quantized copy would add to.

A LoRA checkpoint records the quantization in its `lora.json` (`LoRASpec.quantize`): loading it quantizes the base
the same way before the adapters go back on, so a merged export is the dequantized base plus the update, the
function the adapters were trained against (`LoRALinear.merged`). A base quantized again from the same weights is
the same integers: a resumed run continues on the same base.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gptlab.errors import GptlabError
from gptlab.integer_weights import pack_nibbles, quantize_int4_low, quantize_int8, unpack_nibbles
from gptlab.linear import plain_linear
from gptlab.model import GPT
from gptlab.ops import row_chunks, upcasting_linear
from gptlab.quantize import DEFAULT_GROUP_SIZE, QuantizedLinear, check_options, group_sizes_dividing


class FrozenQuantizedLinear(QuantizedLinear):
    """A frozen Linear's weight as int8 (per row) or int4 (groups of inputs) for QLoRA: x @ W^T + b with W
    dequantized per call, never an inference kernel; gradients to its input, none to its weight (see the module
    docstring). int4 keeps each group's scale and low end (`low`, where `QuantizedLinear` keeps a zero point) in
    fp16."""

    def _store(self, w: torch.Tensor) -> None:
        """Quantized a block of rows at a time into buffers made first: the temporaries are a block's, so loading
        a model layer by layer leaves no holes of a layer's size between the layers' buffers."""
        n, k, group = self.out_features, self.in_features, self.group_size
        int8 = self.mode == "int8"
        self.register_buffer("qweight", torch.empty(n, k if int8 else k // 2, dtype=torch.int8 if int8 else
                                                    torch.uint8, device=w.device))
        self.register_buffer("scale", torch.empty(n, dtype=torch.float32, device=w.device) if int8 else
                             torch.empty(n, k // group, dtype=torch.float16, device=w.device))
        if not int8:
            self.register_buffer("low", torch.empty_like(self.scale))
        if w.is_meta:  # the memory estimate's model
            return
        for rows in row_chunks(n, k, w.device):
            if int8:
                self.qweight[rows], self.scale[rows] = quantize_int8(w[rows])
                continue
            q, scale, low = quantize_int4_low(w[rows], group)
            if not all(torch.equal(t.to(self.scale.dtype).float(), t) for t in (scale, low)):
                self.scale, self.low = self.scale.float(), self.low.float()  # weights beyond fp16's range
            self.qweight[rows], self.scale[rows], self.low[rows] = pack_nibbles(q), scale, low

    def kernel(self, rows: int = 1) -> None:
        return None

    def kernel_name(self, dtype: torch.dtype = torch.bfloat16, rows: int = 1) -> str:
        return f"dequantize + F.linear ({self.mode})"

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                   rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        """The weight this layer computes with, (out, in) in `dtype` (into `out` if given), or its block [rows,
        cols] (int4: cols at whole groups): computed in fp32 a block of rows at a time, so the only full-size
        tensor is the result. Each weight is the same number whatever the block (the arithmetic is per weight)."""
        r0, r1, _ = rows.indices(self.out_features)
        c0, c1, _ = cols.indices(self.in_features)
        if out is None:
            out = torch.empty(r1 - r0, c1 - c0, dtype=dtype, device=self.qweight.device)
        native = self.mode == "int4" and _native_dequantize_int4(self, out)
        if native:  # one pass over the bytes in C++ (kernels/dequantize_int4.cpp): the same numbers to the bit
            g0, g1 = self._group_range(c0, c1)
            native(self.qweight[r0:r1, c0 // 2:c1 // 2], self.scale[r0:r1, g0:g1], self.low[r0:r1, g0:g1], out)
            return out
        for chunk in row_chunks(r1 - r0, c1 - c0, self.qweight.device):
            out[chunk] = self._block_fp32(slice(r0 + chunk.start, r0 + chunk.stop), c0, c1)
        return out

    def _block_fp32(self, rows: slice, c0: int, c1: int) -> torch.Tensor:
        if self.mode == "int8":
            return self.qweight[rows, c0:c1].float().mul_(self.scale[rows, None])
        g0, g1 = self._group_range(c0, c1)
        q = unpack_nibbles(self.qweight[rows, c0 // 2:(c1 + 1) // 2]).float()
        groups = q.view(q.shape[0], -1, self.group_size)
        return groups.mul_(self.scale[rows, g0:g1, None]).add_(self.low[rows, g0:g1, None]).view(q.shape)

    def _group_range(self, c0: int, c1: int) -> tuple[int, int]:
        """The int4 groups that columns c0:c1 cover, which must be whole ones."""
        group = self.group_size
        if c0 % group or c1 % group:
            raise ValueError(f"int4 columns {c0}:{c1} are not whole groups of {group}")
        return c0 // group, c1 // group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizedLinear.apply(x, self)


class _DequantizedLinear(torch.autograd.Function):
    """x @ W^T + b with W dequantized in x's dtype a block at a time, in the forward and again in the backward:
    nothing of the weight is saved between them, and no more of it than a block exists at once (`weight_blocks`).
    The forward takes blocks of W's rows (each gives its columns of the output), the backward blocks of its
    columns (each gives its columns of the input's gradient): every output is the same dot product over the whole
    reduction as with the whole weight, so blocking changes no sum's order."""

    @staticmethod
    def forward(ctx, x, layer):  # noqa: ANN001, ANN205
        ctx.layer = layer
        out = x.new_empty(*x.shape[:-1], layer.out_features)
        for rows in weight_blocks(layer, along_rows=True):
            bias = None if layer.bias is None else layer.bias[rows].to(x.dtype)
            out[..., rows] = upcasting_linear(x, _dequantized(layer, x.dtype, rows, slice(None)), bias)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        layer = ctx.layer
        grad_x = grad.new_empty(*grad.shape[:-1], layer.in_features)
        for cols in weight_blocks(layer, along_rows=False):
            grad_x[..., cols] = upcasting_linear(grad, _dequantized(layer, grad.dtype, slice(None), cols).t())
        return grad_x, None


def _native_dequantize_int4(layer: FrozenQuantizedLinear, out: torch.Tensor):  # noqa: ANN202 - the op, or None
    """gptlab's C++ int4 dequantization (`gptlab.kernels`, built once per machine) where it applies: a CPU, fp16
    scales (fp32 ones, for weights beyond fp16's range, can round differently in it), an fp32 or bf16 `out` with
    contiguous rows, and not under torch.compile; else None (the ATen ops)."""
    if (out.device.type != "cpu" or out.dtype not in (torch.float32, torch.bfloat16) or out.stride(-1) != 1
            or layer.scale.dtype != torch.float16 or torch.compiler.is_compiling()):
        return None
    from gptlab.kernels import widest_ops

    ops = widest_ops()
    return None if ops is None else ops.dequantize_int4


def block_elements(device: torch.device) -> int:
    """Weights per dequantized block: 4M on a CPU (8 MB in bf16: the block is still in the last-level cache when
    its product reads it), 64M on a GPU (where each block costs kernel launches)."""
    return 1 << (22 if device.type == "cpu" else 26)


def weight_blocks(layer: FrozenQuantizedLinear, along_rows: bool, device: torch.device | None = None) -> list[slice]:
    """The layer's weight in blocks of about `block_elements(device)` weights (default: the layer's device): ranges
    of its rows (`along_rows`) or of its columns, each a multiple of 64 (the CPU's GEMMs block their output so) and
    of int4's group."""
    length, other = (layer.out_features, layer.in_features) if along_rows else (layer.in_features, layer.out_features)
    align = 64 if along_rows else math.lcm(64, layer.group_size or 1)
    step = max(align, block_elements(device or layer.qweight.device) // other // align * align)
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]


def workspace_elements(layer: FrozenQuantizedLinear, device: torch.device | None = None) -> int:
    """The largest block `_DequantizedLinear` dequantizes of this layer on `device` (default: the layer's): what
    the shared buffer holds for it."""
    def widest(along_rows: bool) -> int:
        return max(s.stop - s.start for s in weight_blocks(layer, along_rows, device))

    return max(widest(True) * layer.in_features, widest(False) * layer.out_features)


# per (device, dtype): the one buffer every layer's call dequantizes its blocks into, as large as the largest block.
# The calls run one after another (a block's product is done, or queued before the next write on a GPU's stream),
# so one buffer serves them all: no allocation per call, and no freed blocks for the allocator to hold between the
# step's other tensors
_WORKSPACES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dequantized(layer: FrozenQuantizedLinear, dtype: torch.dtype, rows: slice, cols: slice) -> torch.Tensor:
    """The layer's weight block [rows, cols] in `dtype`, in the shared buffer: valid until the next block's call."""
    device = layer.qweight.device
    r0, r1, _ = rows.indices(layer.out_features)
    c0, c1, _ = cols.indices(layer.in_features)
    numel = (r1 - r0) * (c1 - c0)
    buffer = _WORKSPACES.get((device, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = _WORKSPACES[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return layer.dequantize(dtype, out=buffer[:numel].view(r1 - r0, c1 - c0), rows=rows, cols=cols)


def quantize_base(model: GPT, mode: str, group_size: int | None = None) -> GPT:
    """Every Linear of the blocks as a `FrozenQuantizedLinear` (in place, before `add_lora`); returns the model."""
    check_options(mode, group_size)
    for name, _ in base_linears(model):
        quantize_layer(model, name, mode, group_size)
    return model


def base_linears(model: GPT) -> list[tuple[str, nn.Linear]]:
    """The Linears QLoRA quantizes: those of the blocks, by their names in `model`."""
    return [(f"transformer.h.{i}.{name}", layer) for i, block in enumerate(model.iter_blocks())
            for name, layer in block.named_modules() if plain_linear(layer)]


def quantize_layer(model: GPT, name: str, mode: str, group_size: int | None = None) -> FrozenQuantizedLinear:
    """The Linear `name` of `model` replaced by its `FrozenQuantizedLinear` (int4 in groups of `group_size`,
    default 32); a one-line error when the group does not divide its input width."""
    layer = model.get_submodule(name)
    group = (group_size or DEFAULT_GROUP_SIZE) if mode == "int4" else 0
    if group and layer.in_features % group:
        width = layer.in_features
        if group_size is None:  # the default: a training recipe has no group size to choose
            raise GptlabError(f"int4 quantizes in groups of {group} inputs, which do not divide {name}'s input "
                              f"width {width}: quantize to int8 instead")
        raise GptlabError(f"int4 group size {group} does not divide {name}'s input width {width}: "
                          f"choose one of {group_sizes_dividing(width)}")
    with torch.no_grad():
        quantized = FrozenQuantizedLinear(layer, mode, group)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, quantized)
    return quantized
