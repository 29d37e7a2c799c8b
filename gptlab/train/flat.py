"""One flat buffer per kind of tensor for the bf16 working-copy step (`Precision`'s "working" mode).

The working step moves every gradient from the bf16 copy to the fp32 masters, clips, steps, and copies the masters
back. Per parameter that is a cast, a copy, a norm and a scale: four ops each of ~150 tensors for GPT-2, most of a
step's `aten::copy_` calls, and for a tiny model most of its framework time. Here the masters and the working
weights are views into one fp32 and one bf16 buffer (laid out alike), and the masters' gradients views into one
fp32 buffer, so each of the four is a single op over all parameters.

The optimizers keep their Parameters (only `.data` moves into the buffer), so their state and the checkpoints are
as before. A parameter whose gradient is None after backward (not on the loss's path this step) still has none
on its master, as without the buffers: the optimizers skip it.

Where every optimizer is a plain AdamW and gptlab's C++ kernels run on this CPU, `adamw_step` does all of it in
one pass per parameter instead (kernels/adamw.cpp): the bf16 gradients are read as they are, the masters and
their moments updated, and the masters written back rounded into the working weights. 28 bytes move per
parameter instead of 48 (the cast into the buffer, the clipping's norm, the optimizer and the copy back):
GPT-2 124M's step spends ~200 ms in these passes on a 2-core CPU, all at memory speed.
"""

from __future__ import annotations

import math

import torch

from gptlab.train.lean import FusedAdamW


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
        self._index = {id(m): i for i, m in enumerate(self.masters)}  # a master's place in the lists

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
    def adamw_step(self, optimizers: list, max_norm: float, skip: torch.Tensor | None) -> bool:
        """Clip (to a global 2-norm of `max_norm`, if > 0) and step `optimizers` from the working gradients, writing
        the working weights too, in C++ (see the module docstring); False, having done nothing, where that does not
        apply: an optimizer that is not a plain AdamW (`_plain_adamw`), a parameter without a gradient, no kernels
        on this CPU. The update is AdamW's (that of torch's fused kernel within fp32 rounding) with the moments in
        the optimizers' own state, so their state_dict and an exact resume are as after `step`. `skip` (0-dim bool):
        where true nothing changes, decided in the kernel."""
        grads = [w.grad for w in self.working]
        ops = _adamw_ops(self.masters, grads)
        if ops is None or not optimizers or not all(_plain_adamw(opt) for opt in optimizers):
            return False
        scale = 1.0
        if max_norm > 0:  # as clip_coefficient, from the bf16 gradients (each exact in fp32)
            scale = min(max_norm / (math.sqrt(ops.sum_squares(grads)) + 1e-6), 1.0)
        for opt in optimizers:
            for group in opt.param_groups:
                at = [self._index[id(p)] for p in group["params"]]
                states = [_adamw_state(opt, p) for p in group["params"]]
                beta1, beta2 = group["betas"]
                ops.adamw_working([self.masters[i] for i in at], [grads[i] for i in at],
                                  [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                                  [self.working[i] for i in at], [st["step"] for st in states], float(group["lr"]),
                                  beta1, beta2, group["weight_decay"], group["eps"], scale, skip)
        for w in self.working:
            w.grad = None
        return True

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


def _adamw_ops(masters: list[torch.Tensor], grads: list[torch.Tensor | None]):  # noqa: ANN202 - the ops or None
    """gptlab's C++ kernels where `adamw_step` takes these tensors: fp32 masters and contiguous bf16 gradients for
    every one of them, on a CPU; else None."""
    if not masters or any(g is None or g.device.type != "cpu" or g.dtype != torch.bfloat16 or not g.is_contiguous()
                          for g in grads):
        return None
    if any(m.dtype != torch.float32 for m in masters):
        return None
    from gptlab.kernels import widest_ops

    return widest_ops()


def _plain_adamw(opt: object) -> bool:
    """AdamW as `adamw_step` computes it: gptlab's FusedAdamW, or torch's AdamW without amsgrad, maximize or a
    differentiable or capturable step (their state is the same: step, exp_avg, exp_avg_sq)."""
    if isinstance(opt, FusedAdamW):
        return True
    return type(opt) is torch.optim.AdamW and not any(
        g.get(flag) for g in opt.param_groups for flag in ("amsgrad", "maximize", "differentiable", "capturable"))


def _adamw_state(opt, p: torch.Tensor) -> dict:  # noqa: ANN001 - an AdamW
    """p's state in `opt`, made as AdamW makes it on a parameter's first step where it has none yet."""
    state = opt.state.setdefault(p, {})
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _flatten_into(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """A buffer holding `params`' values back to back; each parameter's `.data` becomes its view of it."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    for p, view in zip(params, _views(flat, params), strict=True):
        p.data = view
    return flat


def _views(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """`flat` cut into tensors shaped as `params`, in order."""
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in params]), params, strict=True)]
