"""The frozen reference an objective compares the policy against: the starting weights.

With LoRA it is the same model with its adapters switched off (no second copy in memory); else a frozen copy of
the model made before the first step (one more copy of the weights, in the working dtype). DPO / IPO and GRPO's
KL term share it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gptlab.hooks import eval_mode
from gptlab.lora import adapters_disabled, has_lora

Context = Callable[[], contextlib.AbstractContextManager]


def frozen_reference(model: torch.nn.Module) -> tuple[torch.nn.Module, Context]:
    """(the reference module, the context it runs under): call it before the first step changes `model`."""
    if has_lora(model):  # the base under the adapters is the starting model
        return model, lambda: adapters_disabled(model)
    return copy.deepcopy(model).requires_grad_(False).eval(), contextlib.nullcontext


def token_logps(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, temperature: float) -> torch.Tensor:
    """The (N, T) log-probabilities of the targets of (x, y) under softmax(logits / temperature), the distribution
    the rollouts sampled (0 where the target is -1)."""
    if temperature == 1.0:  # the fused head's loss: no logits kept
        _, losses = net(x, y, reduction="none", check_ids=False)
    else:
        logits = net(x, check_ids=False).logits
        losses = F.cross_entropy((logits.float() / temperature).flatten(0, 1), y.flatten(), ignore_index=-1,
                                 reduction="none")
    return -losses.view(y.shape)


@torch.no_grad()
def reference_forward(reference: torch.nn.Module, context: Context, x: torch.Tensor, y: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """The reference's -log p of each target of (x, y) under softmax(logits / temperature) (`token_logps`; 0 where
    the target is -1), shaped as y, without gradients."""
    with context(), eval_mode(reference):
        return -token_logps(reference, x, y, temperature)
