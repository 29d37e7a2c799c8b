"""One flat buffer per kind of tensor for the bf16 working-copy step (`Precision`'s "working" mode).

The working step moves every gradient from the bf16 copy to the fp32 masters, clips, steps, and copies the masters
back. Per parameter that is a cast, a copy, a norm and a scale: four ops each of ~150 tensors for GPT-2, most of a
step's `aten::copy_` calls, and for a tiny model most of its framework time. Here the masters and the working
weights are views into one fp32 and one bf16 buffer (laid out alike), and the masters' gradients views into one
fp32 buffer, so each of the four is a single op over all parameters.

The optimizers keep their Parameters (only `.data` moves into the buffer), so their state and the checkpoints are
as before. A parameter whose gradient is None after backward (not on the loss's path this step) still has none
on its master, as without the buffers: the optimizers skip it.
"""

from __future__ import annotations

import torch


class FlatCopy:
    """The fp32 masters and the bf16 working weights of `pairs` ((working, master) Parameters, the same order and
    shapes) moved into flat buffers; `grads_to_masters`, `clip_` and `sync` are one op each."""

    def __init__(self, pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]]) -> None:
        self.working = [w for w, _ in pairs]
        self.masters = [m for _, m in pairs]
        self.master_data = _flatten_into(self.masters)
        self.working_data = _flatten_into(self.working)
        self.master_grad = torch.zeros_like(self.master_data)
        self._grad_views = _views(self.master_grad, self.masters)

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """The working gradients, cast to fp32, become the masters' (one `cat` into the buffer); the working ones
        are dropped. Where some parameter has no gradient, each one that has is cast on its own."""
        grads = [w.grad for w in self.working]
        if all(g is not None for g in grads):
            torch.cat([g.reshape(-1) for g in grads], out=self.master_grad)
            for m, view in zip(self.masters, self._grad_views, strict=True):
                m.grad = view
        else:
            for m, g, view in zip(self.masters, grads, self._grad_views, strict=True):
                view.copy_(g) if g is not None else view.zero_()  # zeros: no stale gradient in the norm
                m.grad = None if g is None else view
        for w in self.working:
            w.grad = None

    @torch.no_grad()
    def clip_coefficient(self, max_norm: float) -> torch.Tensor:
        """What scales the masters' gradients to a global 2-norm of at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` computes it (max_norm / (norm + 1e-6), at most 1), over the buffer: the
        norm of all gradients at once (`global_norm`) rather than the norm of per-tensor norms (equal up to
        rounding). A parameter without a gradient has zeros in the buffer, which change no norm. A 0-dim tensor."""
        return torch.clamp(max_norm / (global_norm(self.master_grad) + 1e-6), max=1.0)

    @torch.no_grad()
    def clip_(self, max_norm: float) -> None:
        """Scale the masters' gradients by `clip_coefficient`: one pass over the buffer."""
        self.master_grad.mul_(self.clip_coefficient(max_norm))

    @torch.no_grad()
    def sync(self) -> None:
        """The masters, cast, into the working weights: one copy over the buffer."""
        self.working_data.copy_(self.master_data)


def global_norm(flat: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """The 2-norm of a long 1-D tensor as the norm of its blocks' norms. ATen's one fp32 reduction over GPT-2's
    124M gradients drifts by ~1.5% (clip_grad_norm_'s norm of per-tensor norms by ~0.1%); blocks of 4,096 keep it
    within ~1e-6, in half the time (one read of the buffer, at memory speed)."""
    whole = flat.numel() // block * block
    blocks = torch.linalg.vector_norm(flat[:whole].view(-1, block), dim=1)
    return torch.linalg.vector_norm(torch.cat([blocks, flat[whole:]]))


def _flatten_into(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """A buffer holding `params`' values back to back; each parameter's `.data` becomes its view of it."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    for p, view in zip(params, _views(flat, params), strict=True):
        p.data = view
    return flat


def _views(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """`flat` cut into tensors shaped as `params`, in order."""
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in params]), params, strict=True)]
