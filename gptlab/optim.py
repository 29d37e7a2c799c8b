"""Optimizers and learning-rate schedules for `gptlab train`.

Two setups:
- "adamw": AdamW on everything, weight decay on the hidden weight matrices only.
- "muon":  torch.optim.Muon on the hidden weight matrices (orthogonalized momentum: roughly 2x fewer steps to
  the
           same loss in short runs) and AdamW, without decay, on embeddings, the LM head and vectors (norms,
           biases).

Schedules are multipliers of each group's peak learning rate, a function of progress in [0, 1] (step /
max_steps,
or elapsed / max_time for time budgets) and the step (for warm-up).
"""

from __future__ import annotations

import math

import torch

from gptlab.trainer_config import TrainConfig


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """Fused AdamW runs one kernel over all tensors (CPU and CUDA): much faster than the per-tensor loop."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def adamw(groups: list[dict], cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, fused=_fused_ok(params) or None
    )


def build_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """The optimizers for `model` (a plain GPT). Each param group records its peak lr in `peak_lr`."""
    kinds = model.parameter_groups_by_kind()
    if cfg.optimizer == "adamw":
        optimizers = [adamw(model.optimizer_groups(cfg.weight_decay), cfg)]
    else:
        matrices = [p for _, p in kinds["matrix"]]
        rest = [p for kind in ("embedding", "head", "vector") for _, p in kinds[kind]]
        optimizers = []
        if matrices:
            # adjust_lr_fn="original" scales lr by sqrt(max(1, rows/cols)) per matrix, as in
            # Keller Jordan's Muon
            optimizers.append(
                torch.optim.Muon(
                    matrices,
                    lr=cfg.muon_lr,
                    momentum=cfg.muon_momentum,
                    nesterov=cfg.muon_nesterov,
                    weight_decay=cfg.muon_weight_decay,
                    adjust_lr_fn="original",
                )
            )
        optimizers.append(adamw([{"params": rest, "weight_decay": 0.0}], cfg))
    for opt in optimizers:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return optimizers


def lr_multiplier(cfg: TrainConfig, step: int, progress: float) -> float:
    """The factor applied to every peak learning rate at `step` (0-based) and `progress` in [0, 1].

    Linear warm-up over `warmup_steps`, then
    - cosine: cosine decay from 1 to min_lr over the run;
    - wsd:    stable at 1, then linear decay to min_lr over the last `decay_fraction` of the run;
    - constant.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    floor = cfg.min_lr
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        start = 1.0 - cfg.decay_fraction
        if progress <= start or cfg.decay_fraction == 0:
            return 1.0
        return floor + (1.0 - floor) * (1.0 - progress) / cfg.decay_fraction
    # cosine over the part of the run after warm-up (by steps, or by time when progress is time-driven)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> float:
    """Scale every group's peak lr; returns AdamW's current lr (the one logged)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * multiplier
    return optimizers[-1].param_groups[0]["lr"]
