"""Optimizers and learning-rate schedules for `gptlab train`, described by two small specs.

A recipe becomes an `OptimizerSpec` (which optimizer, its hyper-parameters: `optimizer_spec`) and a `Schedule`
(how the learning rate moves over the run: `lr_schedule`); nothing else here needs the whole TrainConfig, so the
parts can be used and tested on their own (benchmarks/train_throughput.py builds a training step from them).

Two setups:
- "adamw": AdamW on everything, weight decay on the hidden weight matrices only.
- "muon":  Muon on the hidden weight matrices (orthogonalized momentum: about 2x fewer steps to the same loss
           in short runs) and AdamW, without decay, on embeddings, the LM head and vectors (norms, biases).
Only trainable parameters (requires_grad) go into the optimizers: a frozen base model under adapters is never
decayed or stepped, and an optimizer that would get no parameters is not built.
Two implementations (`impl`): "torch" (torch.optim.AdamW(fused=True), torch.optim.Muon) and "gptlab"
(FusedAdamW, BatchedMuon below: the same updates, a second less start-up and a faster Muon for small models).

Schedules are multipliers of each group's peak learning rate, functions of the step (for warm-up) and of the
decay's progress in [0, 1], which counts only what follows warm-up: 0 when warm-up ends, 1 at max_steps (or at
max_time for time budgets), as nanoGPT's `get_lr` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from gptlab.errors import GptlabError
from gptlab.train.lean import FusedAdamW, LeanOptimizer
from gptlab.train.muon import BatchedMuon, split_torch_muon, torch_muon

if TYPE_CHECKING:
    from gptlab.train.config import TrainConfig

__all__ = ["BatchedMuon", "FusedAdamW", "LeanOptimizer", "OptimizerSpec", "Schedule", "build_optimizers",
           "lr_schedule", "optimizer_spec", "set_lr", "step_optimizers", "takes_found_inf"]


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyper-parameters (TrainConfig's fields of the same meaning)."""

    kind: Literal["adamw", "muon"] = "adamw"
    lr: float = 1e-3  # AdamW's peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # AdamW's, on hidden matrices (adamw only: under muon AdamW has no decay)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_weight_decay: float = 0.0
    impl: Literal["torch", "gptlab"] = "torch"


@dataclass(frozen=True)
class Schedule:
    """The learning-rate schedule: linear warm-up over `warmup_steps` (step s gets (s + 1) / warmup_steps, so the
    last warm-up step is at the peak), then, over the rest of the run:
    - cosine:   cosine decay from 1 to min_lr;
    - wsd:      stable at 1, then linear decay to min_lr over the last `decay_fraction` of it;
    - constant.
    `min_lr` is a fraction of the peak learning rate. The decay's `progress` comes from `step_progress` or
    `time_progress`: 0 where warm-up ends, so the learning rate leaves the peak continuously."""

    warmup_steps: int = 10
    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    min_lr: float = 0.0
    decay_fraction: float = 0.5

    def multiplier(self, step: int, progress: float) -> float:
        """The factor applied to every peak learning rate at `step` (0-based), with the decay `progress` in
        [0, 1] (the share of the run after warm-up that is done)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(max(progress, 0.0), 1.0)
        floor = self.min_lr
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":
            start = 1.0 - self.decay_fraction
            if progress <= start or self.decay_fraction == 0:
                return 1.0
            return floor + (1.0 - floor) * (1.0 - progress) / self.decay_fraction
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def at(self, step: int, max_steps: int, *, clock: float = 0.0, max_time: float | None = None,
           warmup_elapsed: float | None = None) -> float:
        """The factor at `step`: its decay follows the steps and, under a time budget whose warm-up ended at
        `warmup_elapsed`, the `clock` too (whichever of max_steps and max_time is nearer)."""
        progress = self.step_progress(step, max_steps)
        if max_time is not None and warmup_elapsed is not None:
            progress = max(progress, self.time_progress(clock, max_time, warmup_elapsed))
        return self.multiplier(step, progress)

    def step_progress(self, step: int, max_steps: int) -> float:
        """The decay's progress at `step` of a `max_steps` run: (step - warmup) / (max_steps - warmup)."""
        return _share(step - self.warmup_steps, max_steps - self.warmup_steps)

    @staticmethod
    def time_progress(elapsed: float, max_time: float, warmup_elapsed: float) -> float:
        """The decay's progress `elapsed` seconds into a `max_time` budget whose warm-up ended at
        `warmup_elapsed`: (elapsed - warmup_elapsed) / (max_time - warmup_elapsed)."""
        return _share(elapsed - warmup_elapsed, max_time - warmup_elapsed)


def optimizer_spec(cfg: TrainConfig) -> OptimizerSpec:
    """The recipe's optimizer settings, as this module takes them."""
    return OptimizerSpec(
        kind=cfg.optimizer, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
        muon_lr=cfg.muon_lr, muon_momentum=cfg.muon_momentum, muon_nesterov=cfg.muon_nesterov,
        muon_weight_decay=cfg.muon_weight_decay, impl=cfg.optimizer_impl,
    )


def lr_schedule(cfg: TrainConfig) -> Schedule:
    """The recipe's learning-rate schedule."""
    return Schedule(warmup_steps=cfg.warmup_steps, kind=cfg.schedule, min_lr=cfg.min_lr,
                    decay_fraction=cfg.decay_fraction)


def _share(done: float, span: float) -> float:
    """done / span clamped to [0, 1]; 1 when nothing is left to decay over."""
    return 1.0 if span <= 0 else min(max(done / span, 0.0), 1.0)


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """Fused AdamW runs one kernel over all tensors (CPU and CUDA): much faster than the per-tensor loop."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def adamw(groups: list[dict], spec: OptimizerSpec) -> torch.optim.Optimizer | FusedAdamW:
    """AdamW over `groups` (each with its own weight_decay), fused where the kernel supports the tensors."""
    params = [p for g in groups for p in g["params"]]
    kwargs = dict(lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps)
    if spec.impl == "gptlab" and _fused_ok(params):
        return FusedAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, **kwargs, fused=_fused_ok(params) or None)


def build_optimizers(model: torch.nn.Module, spec: OptimizerSpec, *, rank: int = 0, world: int = 1) -> list:
    """The optimizers for `model`'s trainable parameters (a plain GPT, or one with frozen parts).

    The parameters come from the model's own grouping (`parameter_groups_by_kind`, `optimizer_groups`), which
    leaves frozen ones out. Each param group records its peak lr in `peak_lr`, which `set_lr` scales.
    `rank` of `world` replicas (DDP, whose gradients are all-reduced before the step): Muon orthogonalizes this
    process's share of the matrices and gathers the rest (`gptlab.train.muon`); every process must then step
    together. Sharded parameters (FSDP) are not whole matrices: leave world at 1 there.
    """
    if spec.kind == "adamw":
        groups = model.optimizer_groups(spec.weight_decay)
        optimizers = [adamw(groups, spec)] if groups else []
    else:
        kinds = model.parameter_groups_by_kind()
        matrices = [p for _, p in kinds["matrix"]]
        rest = [p for kind in ("embedding", "head", "vector") for _, p in kinds[kind]]
        optimizers = []
        if matrices:
            kwargs = dict(lr=spec.muon_lr, momentum=spec.muon_momentum, nesterov=spec.muon_nesterov,
                          weight_decay=spec.muon_weight_decay)
            if spec.impl == "gptlab":
                optimizers.append(BatchedMuon(matrices, **kwargs, rank=rank, world=world))
            elif world == 1:  # "original" scales lr by sqrt(max(1, rows/cols)) per matrix, as Keller Jordan's Muon
                optimizers.append(torch_muon()(matrices, **kwargs, adjust_lr_fn="original"))
            else:
                optimizers.append(split_torch_muon()(matrices, **kwargs, adjust_lr_fn="original", rank=rank,
                                                     world=world))
        if rest:
            optimizers.append(adamw([{"params": rest, "weight_decay": 0.0}], spec))
    if not optimizers:
        raise GptlabError("the model has no trainable parameters (every one has requires_grad=False)")
    for opt in optimizers:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return optimizers


def set_lr(optimizers: list, multiplier: float) -> None:
    """Set every group's learning rate to its peak lr times `multiplier`."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * multiplier


def takes_found_inf(opt: object) -> bool:
    """Whether `opt.step()` reads a `found_inf` attribute (GradScaler's protocol for fused optimizers) and changes
    nothing where it is 1: torch's fused optimizers, FusedAdamW and BatchedMuon."""
    return isinstance(opt, (FusedAdamW, BatchedMuon)) or bool(getattr(opt, "_step_supports_amp_scaling", False))


def takes_grad_scale(opt: object) -> bool:
    """Whether `opt.step()` divides the gradients by a `grad_scale` attribute as it reads them (GradScaler's
    protocol): torch's fused optimizers and FusedAdamW (BatchedMuon reads found_inf only)."""
    return takes_found_inf(opt) and not isinstance(opt, BatchedMuon)


def step_optimizers(optimizers: list, skip: torch.Tensor | None = None,
                    grad_scale: torch.Tensor | None = None) -> None:
    """Step every optimizer, unless `skip` (a 0-dim bool tensor) is true: then neither the weights nor the
    optimizer state change. Optimizers that take `found_inf` decide on the device, so the host never waits for
    the step's loss; others (torch.optim.Muon, unfused AdamW) cost one read of `skip`, as GradScaler reads
    found_inf for them. `grad_scale` (a 0-dim tensor, for optimizers that `takes_grad_scale`): the gradients are
    divided by it in the update (the clipping's coefficient, inverted)."""
    if grad_scale is not None and not all(takes_grad_scale(opt) for opt in optimizers):
        raise ValueError("grad_scale is for optimizers that divide the gradients by it (takes_grad_scale)")
    found_inf, host_skip = (None if skip is None else skip.float()), None
    for opt in optimizers:
        handed = {} if grad_scale is None else {"grad_scale": grad_scale}
        if found_inf is not None and takes_found_inf(opt):
            handed["found_inf"] = found_inf
        elif found_inf is not None:  # decided on the host
            host_skip = bool(skip) if host_skip is None else host_skip
            if host_skip:
                continue
        for name, value in handed.items():
            setattr(opt, name, value)
        try:
            opt.step()
        finally:
            for name in handed:
                delattr(opt, name)
