"""The LM head and its cross-entropy as one autograd node, in training on a CPU.

The loss's gradient with respect to the logits is each row's softmax minus its one-hot, times the scale the loss's
reduction gives it (1 / the counted targets for a mean), which only backward knows. `ops.cross_entropy` makes the
softmax in its forward's one pass of exp over the logits, and its backward scales it: one more pass over the
logits' gradient (GPT-2's 1,024 x 50,257 in bf16: ~100 MB, ~28 ms of a 1.1 s step on a 2-core CPU). The head's
backward then multiplies that gradient by the weight and by the hidden states. Both products are linear in it, so
here the scale goes onto the small things instead: the input's gradient (N x C) after its product, the hidden
states before the weight's. No pass over the logits' gradient is left besides the two products that read it.

With tied embeddings (GPT-2, SmolLM2) the weight is also the token table, whose gradient autograd would make
dense (a zero fill of V x C) and add to the head's (another pass): ~33 ms of GPT-2's step. Here the head's node
leaves its weight gradient in a `TiedGradient` for the token lookup's node (`tied_embedding`), which runs last in
backward and adds its rows into it: one V x C gradient, made once.

The logits are still returned (the model's output has them) and stay differentiable: a caller whose loss also
reads them gets their gradient added in, through the plain path. Used where `ops.cross_entropy`'s C++ kernel runs
in training (an x86 CPU, fp32 or bf16 logits, outside torch.compile), for a plain nn.Linear head computed in its
own dtype, soft-capped or not (the cap's derivative, 1 - tanh^2, kept from the forward, multiplies the logits'
gradient once); the model takes its unfused path elsewhere (hooks on the logits, a quantized head).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.ops import _native_softmax_xent, logits_gradient, split_product, split_weight_grad, upcasts


class _HeadCrossEntropy(torch.autograd.Function):
    """(logits, per-row losses) of h (N, C) through the head (weight (V, C), bias) against targets (N,), -1
    ignored. Forward: the product, then the kernel's loss and softmax-minus-one-hot (zero on ignored rows), kept
    for backward in the logits' dtype."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, xent, tied, cap):  # noqa: ANN001, ANN205
        logits = split_product(h, weight, bias)
        slope = None
        if cap is not None:  # the model's soft-cap, its ops as the unfused path runs them (the same bits)
            t = torch.tanh(logits / cap)
            logits, slope = cap * t, 1 - t.square()  # d(capped) / d(raw) = 1 - tanh^2
        losses, probs = xent(logits, targets, True)
        ctx.save_for_backward(h, weight, probs, targets != -1, slope)
        ctx.has_bias, ctx.tied = bias is not None, tied
        ctx.set_materialize_grads(False)
        return logits, losses

    @staticmethod
    def backward(ctx, grad_logits, grad_losses):  # noqa: ANN001, ANN205
        h, weight, probs, valid, slope = ctx.saved_tensors
        if grad_losses is None and grad_logits is None:
            return None, None, None, None, None, None, None
        if grad_logits is None and grad_losses.stride(0) == 0:  # one scale for every row: a mean or a sum
            scale = grad_losses[0].float()  # applied in fp32 (a bf16 1 / count would be off by up to 2^-9)
            g, h_scaled, after = probs, (h.float() * scale).to(h.dtype), scale
        else:  # per-row scales, or the logits read elsewhere too: the gradient spelled out, as the unfused path's
            g = grad_logits if grad_losses is None else logits_gradient(probs, valid, grad_losses)
            if grad_losses is not None and grad_logits is not None:
                g = g + grad_logits  # as autograd sums the two there
            h_scaled, after = h, None
        if slope is not None:  # through the soft-cap: the raw logits' gradient
            g = g * slope
        gh = gw = gb = None
        if ctx.needs_input_grad[0]:
            gh = g @ weight
            gh = gh if after is None else gh.mul_(after)
        if ctx.needs_input_grad[1]:
            gw = split_weight_grad(g, h_scaled)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0) if after is None else g.sum(0).mul_(after)
        if ctx.tied is not None and gw is not None:  # handed on to the token lookup's node, which returns it
            ctx.tied.grad, gw = gw, None
        return gh, gw, gb, None, None, None, None


class TiedGradient:
    """A tied LM head's weight gradient on its way from the head's node to the token lookup's (module docstring);
    one per forward."""

    grad: torch.Tensor | None = None


class _TokenEmbedding(torch.autograd.Function):
    """F.embedding(idx, weight); backward adds the rows into the gradient the head's node left in `tied`
    (index_add_, which sums a bf16 table's rows in fp32 on a CPU: nearer the exact sums than F.embedding's own
    backward, which adds them in bf16), or makes it as F.embedding's backward does where the head's node left
    none."""

    @staticmethod
    def forward(ctx, idx, weight, tied):  # noqa: ANN001, ANN205
        ctx.save_for_backward(idx)
        ctx.tied, ctx.rows = tied, weight.shape[0]
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (idx,) = ctx.saved_tensors
        gw, ctx.tied.grad = ctx.tied.grad, None  # (dropped here: autograd then keeps gw itself, no copy)
        if gw is None:
            return None, torch.ops.aten.embedding_dense_backward(grad, idx, ctx.rows, -1, False), None
        gw.index_add_(0, idx.reshape(-1), grad.reshape(-1, grad.shape[-1]))  # (summed in fp32 on a CPU)
        return None, gw, None


def tied_gradient(wte: nn.Module, head: nn.Module) -> TiedGradient | None:
    """A hand-off for this forward where the head shares the token table's weight and training reaches it
    through the loss: a plain table (no padding index or max norm, a plain Parameter: not a sharded one) on a
    CPU, a gradient wanted, and nothing hooked on the table's module (the lookup then bypasses its call)."""
    if (not torch.is_grad_enabled() or getattr(head, "weight", None) is not wte.weight  # a quantized head has none
            or type(wte) is not nn.Embedding or type(wte.weight) is not nn.Parameter or wte.padding_idx is not None
            or wte.max_norm is not None or not wte.weight.requires_grad or wte.weight.device.type != "cpu"
            or _hooked(wte)):
        return None
    return TiedGradient()


def _hooked(module: nn.Module) -> bool:
    """Whether anything runs on `module`'s call: its own forward hooks or everyone's."""
    from torch.nn.modules import module as modules

    return bool(module._forward_hooks or module._forward_pre_hooks or modules._global_forward_hooks
                or modules._global_forward_pre_hooks)


def tied_embedding(idx: torch.Tensor, weight: torch.Tensor, tied: TiedGradient | None) -> torch.Tensor:
    """The token table's rows for idx; with `tied`, through the node that takes the head's gradient on."""
    return F.embedding(idx, weight) if tied is None else _TokenEmbedding.apply(idx, weight, tied)


def head_cross_entropy(h: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                       tied: TiedGradient | None = None, softcap: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits (B, T, V), per-token losses (B * T,)) of final hidden states h (B, T, C) through `head` against
    targets (B, T) in one autograd node (module docstring), or None where it does not apply. `tied`: the one the
    token lookup of this forward went through (`tied_embedding`), for a head that shares its weight. `softcap`:
    the logits are softcap * tanh(raw / softcap) (Gemma 2's, the speedrun's), as `GPT.softcap_logits` makes them."""
    xent = _xent(h, head)
    if xent is None:
        return None
    B, T, C = h.shape
    logits, losses = _HeadCrossEntropy.apply(h.reshape(B * T, C), head.weight, head.bias, targets.reshape(-1).long(),
                                             xent, tied, softcap)
    return logits.view(B, T, -1), losses


def _xent(h: torch.Tensor, head: nn.Module) -> Any | None:
    """The cross-entropy kernel where the fused node applies: a plain Linear head in h's dtype (not through fp32 on a
    CPU without bf16 matmuls), a gradient wanted, the kernel taking logits of this dtype in training."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return None
    w = head.weight
    if (w.dtype != h.dtype or upcasts(h, w) or not torch.is_grad_enabled()
            or not (h.requires_grad or w.requires_grad)):
        return None
    return _native_softmax_xent(h.new_empty(0, w.shape[0]), True)
