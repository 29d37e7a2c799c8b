"""QLoRA's frozen base (Dettmers et al. 2023): a pretrained model's block Linears stored as int8 or int4 (gptlab's
own formats, `quantize`'s arithmetic, not NF4), LoRA adapters trained over them.

What a quantized layer keeps, and nothing more: int4 as two weights a byte with an fp16 scale and an fp16 low end
per group of inputs (w = q * scale + low, 0.625 bytes a weight at groups of 32; `quantize_int4` makes both fp16
values, so fp16 holds them exactly: fp32 only for weights beyond fp16's range), int8 as a byte a weight with an
fp32 scale per row. No fp32 copy of the base exists at any point: loading quantizes one layer as it is read
(`loading.load_frozen_base`), and each call dequantizes its layer's weight into the compute dtype, a block of rows
at a time through fp32 (rounded once, as casting the fp32 dequantized weight would), uses it and drops it:
`_DequantizedLinear` saves nothing for backward and dequantizes again there. So one layer's weight exists at a
time, forward and backward. Evaluation and rollouts run the same function (no inference kernel's packed copy,
which would double the base's bytes).

The embeddings, norms and LM head stay in the compute dtype, as QLoRA and peft keep them: a lookup reads one row
per token, and a tied head (GPT-2's) is the embedding's own table, which a quantized copy would add to.

A LoRA checkpoint records the quantization in its `lora.json` (`LoRASpec.quantize`): loading it quantizes the base
the same way before the adapters go back on, so a merged export is the dequantized base plus the update, the
function the adapters were trained against (`LoRALinear.merged`). A base quantized again from the same weights is
the same integers: a resumed run continues on the same base.
"""

from __future__ import annotations

import torch
from torch import nn

from gptlab.errors import GptlabError
from gptlab.integer_weights import pack_nibbles, quantize_int4_low, quantize_int8, unpack_nibbles
from gptlab.model import GPT
from gptlab.ops import row_chunks, upcasting_linear
from gptlab.quantize import DEFAULT_GROUP_SIZE, QuantizedLinear, check_options


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

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight this layer computes with, (out, in) in `dtype` (into `out` if given): computed in fp32 a
        block of rows at a time, so the only full-size tensor is the result."""
        if out is None:
            out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.qweight.device)
        for rows in row_chunks(self.out_features, self.in_features, self.qweight.device):
            out[rows] = self._rows_fp32(rows)
        return out

    def _rows_fp32(self, rows: slice) -> torch.Tensor:
        if self.mode == "int8":
            return self.qweight[rows].float().mul_(self.scale[rows, None])
        q = unpack_nibbles(self.qweight[rows]).float()
        groups = q.view(q.shape[0], -1, self.group_size)
        return groups.mul_(self.scale[rows, :, None]).add_(self.low[rows, :, None]).view(q.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizedLinear.apply(x, self)


class _DequantizedLinear(torch.autograd.Function):
    """x @ W^T + b with W dequantized in x's dtype for the forward and again for the backward: nothing of the
    weight is saved between them."""

    @staticmethod
    def forward(ctx, x, layer):  # noqa: ANN001, ANN205
        ctx.layer = layer
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return upcasting_linear(x, _dequantized(layer, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return upcasting_linear(grad, _dequantized(ctx.layer, grad.dtype).t()), None


# per (device, dtype): the one buffer every layer's call dequantizes its weight into, as large as the largest layer.
# The calls run one after another (a layer's product is done, or queued before the next write on a GPU's stream),
# so one buffer serves them all: no allocation per call, and no freed weight-sized blocks for the allocator to
# hold between the step's other tensors
_WORKSPACES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dequantized(layer: FrozenQuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight in `dtype`, in the shared buffer: valid until the next layer's call."""
    device, numel = layer.qweight.device, layer.out_features * layer.in_features
    buffer = _WORKSPACES.get((device, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = _WORKSPACES[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return layer.dequantize(dtype, out=buffer[:numel].view(layer.out_features, layer.in_features))


def quantize_base(model: GPT, mode: str, group_size: int | None = None) -> GPT:
    """Every Linear of the blocks as a `FrozenQuantizedLinear` (in place, before `add_lora`); returns the model."""
    check_options(mode, group_size)
    for name, _ in base_linears(model):
        quantize_layer(model, name, mode, group_size)
    return model


def base_linears(model: GPT) -> list[tuple[str, nn.Linear]]:
    """The Linears QLoRA quantizes: those of the blocks, by their names in `model`."""
    return [(f"transformer.h.{i}.{name}", layer) for i, block in enumerate(model.iter_blocks())
            for name, layer in block.named_modules() if type(layer) is nn.Linear]


def quantize_layer(model: GPT, name: str, mode: str, group_size: int | None = None) -> FrozenQuantizedLinear:
    """The Linear `name` of `model` replaced by its `FrozenQuantizedLinear` (int4 in groups of `group_size`,
    default 32); a one-line error when the group does not divide its input width."""
    layer = model.get_submodule(name)
    group = (group_size or DEFAULT_GROUP_SIZE) if mode == "int4" else 0
    if group and layer.in_features % group:
        raise GptlabError(f"int4 group size {group} does not divide {name}'s input width {layer.in_features}:"
                          " choose another group size, or int8")
    with torch.no_grad():
        quantized = FrozenQuantizedLinear(layer, mode, group)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, quantized)
    return quantized
