"""QLoRA's frozen base (Dettmers et al. 2023): a pretrained model's block Linears stored as int8 or int4
(`quantize.QuantizedLinear`, gptlab's own formats, not NF4), LoRA adapters trained over them.

A quantized layer computes with its dequantized weight. In training (gradients on) `_DequantizedLinear`
dequantizes the weight for the forward and again for the backward instead of keeping the fp32 copy for backward:
only the integers and their scales stay in memory, one layer's fp32 weight at a time is made and dropped.
Without gradients (evaluation, rollouts, chat) the layer runs its inference kernels.
The embeddings, norms and LM head stay as they are (the head often shares the embedding's table).

A LoRA checkpoint records the quantization in its `lora.json` (`LoRASpec.quantize`): loading it quantizes the base
the same way before the adapters go back on, so a merged export is the dequantized base plus the update, the
function the adapters were trained against (`LoRALinear.merged`). A base quantized again from the same weights is
the same integers: a resumed run continues on the same base.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.quantize import DEFAULT_GROUP_SIZE, QuantizedLinear, check_options


class FrozenQuantizedLinear(QuantizedLinear):
    """A `QuantizedLinear` that also trains what is around it: gradients to its input, none to its weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training: exactly the dequantized weight, as the merged export has it
            return _DequantizedLinear.apply(x, self)
        return super().forward(x)


class _DequantizedLinear(torch.autograd.Function):
    """x @ dequantized(W)^T + b, dequantizing again in backward rather than saving the fp32 weight."""

    @staticmethod
    def forward(ctx, x, layer):  # noqa: ANN001, ANN205
        ctx.layer = layer
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return F.linear(x, layer.dequantize().to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad @ ctx.layer.dequantize().to(grad.dtype), None


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

