"""Optimizers and learning-rate schedules for `gptlab train`, described by two small specs.

The trainer turns its recipe into an `OptimizerSpec` (which optimizer, its hyper-parameters) and a `Schedule`
(how the learning rate moves over the run); nothing here needs the whole TrainConfig, so the parts can be used
and tested on their own (benchmarks/train_throughput.py builds a training step from them).

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
from typing import Literal

import torch

from gptlab.errors import GptlabError
from gptlab.ops import native_low_precision_matmul


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

    def step_progress(self, step: int, max_steps: int) -> float:
        """The decay's progress at `step` of a `max_steps` run: (step - warmup) / (max_steps - warmup)."""
        return _share(step - self.warmup_steps, max_steps - self.warmup_steps)

    @staticmethod
    def time_progress(elapsed: float, max_time: float, warmup_elapsed: float) -> float:
        """The decay's progress `elapsed` seconds into a `max_time` budget whose warm-up ended at
        `warmup_elapsed`: (elapsed - warmup_elapsed) / (max_time - warmup_elapsed)."""
        return _share(elapsed - warmup_elapsed, max_time - warmup_elapsed)


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


class LeanOptimizer:
    """The part of torch.optim.Optimizer that gptlab uses: param_groups, state, step, zero_grad, state_dict and
    load_state_dict (in torch's format), without torch.optim's import of torch._dynamo on first use: about a
    second of start-up, a fifth of a CPU speedrun. Select with `optimizer_impl = "gptlab"`.
    """

    def __init__(self, params, defaults: dict) -> None:  # noqa: ANN001 - tensors or param-group dicts
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.defaults = defaults
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict] = {}

    def _stepping(self, group: dict, fresh_state) -> list[torch.Tensor]:  # noqa: ANN001 - param -> dict
        """The group's parameters that have gradients, each given `fresh_state(p)` on its first step."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state.get(p):
                self.state[p] = fresh_state(p)
        return params

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        groups = [{**g, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": {index[id(p)]: dict(st) for p, st in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups than this optimizer")
        for group, saved_group in zip(self.param_groups, saved, strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.state = {params[int(i)]: {k: v.to(params[int(i)].device) if isinstance(v, torch.Tensor) else v
                                       for k, v in st.items()}
                      for i, st in state_dict["state"].items()}


class FusedAdamW(LeanOptimizer):
    """AdamW through the fused kernel that torch.optim.AdamW(fused=True) calls: bit-identical updates.

    Like torch's fused AdamW it takes GradScaler's `grad_scale` / `found_inf` attributes (set for the step):
    where `found_inf` is 1 the kernel changes nothing, a decision taken on the device, with no host read."""

    _step_supports_amp_scaling = True  # GradScaler then hands found_inf over instead of reading it

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),  # noqa: ANN001
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = self._stepping(group, lambda p: {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                                      "exp_avg": torch.zeros_like(p),
                                                      "exp_avg_sq": torch.zeros_like(p)})
            if not params:
                continue
            states = [self.state[p] for p in params]
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(params, [p.grad for p in params], [st["exp_avg"] for st in states],
                                [st["exp_avg_sq"] for st in states], [], steps, lr=group["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                maximize=False, grad_scale=grad_scale, found_inf=found_inf)
            if found_inf is not None:  # a skipped step is not counted (bias correction), as torch's fused AdamW
                torch._foreach_sub_(steps, [found_inf] * len(steps))


class BatchedMuon(LeanOptimizer):
    """torch.optim.Muon's update, with matrices orthogonalized together in batched Newton-Schulz calls.

    Small models have a few matrix shapes repeated in every layer: a few batched calls (`newton_schulz_stacks`)
    instead of one per matrix save most of the tiny matmuls' overhead. Same hyper-parameters and state
    ("momentum_buffer") as torch.optim.Muon with adjust_lr_fn="original": B = momentum * B + g; update =
    NS(g + momentum * B) (Nesterov) or NS(B); p -= lr * sqrt(max(1, rows / cols)) * update, after decoupled
    weight decay.
    """

    def __init__(
        self,
        params,  # noqa: ANN001 - tensors or param-group dicts
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps)
        super().__init__(params, defaults)
        if any(p.ndim != 2 for group in self.param_groups for p in group["params"]):
            raise ValueError("Muon only takes 2-D weight matrices")

    @torch.no_grad()
    def step(self) -> None:
        # found_inf (a 0-dim tensor, set for the step as GradScaler sets it on fused optimizers): where it is 1
        # nothing changes. Decided on the device by selecting the old values back (torch.where), so a finite
        # step computes exactly what it did without it
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf != 0
        for group in self.param_groups:
            params = self._stepping(group, lambda p: {"momentum_buffer": torch.zeros_like(p)})
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            mu = group["momentum"]
            if skip is None:
                torch._foreach_mul_(bufs, mu)
                torch._foreach_add_(bufs, grads)
            else:
                for b, new in zip(bufs, torch._foreach_add(torch._foreach_mul(bufs, mu), grads), strict=True):
                    torch.where(skip, b, new, out=b)
            updates = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
            for idx, (rows_max, cols_max) in newton_schulz_stacks([p.shape for p in params]):
                wide = updates[idx[0]].new_zeros(len(idx), rows_max, cols_max)  # zero padding changes nothing
                for j, i in enumerate(idx):
                    u = updates[i].mT if updates[i].size(0) > updates[i].size(1) else updates[i]
                    wide[j, : u.size(0), : u.size(1)] = u
                ortho = newton_schulz(wide, group["ns_steps"], group["ns_coefficients"], group["eps"])
                for j, i in enumerate(idx):
                    rows, cols = params[i].shape
                    o = ortho[j, : min(rows, cols), : max(rows, cols)]
                    o = o.mT if rows > cols else o
                    self._apply(params[i], o, group, math.sqrt(max(1.0, rows / cols)), skip)

    @staticmethod
    def _apply(p: torch.Tensor, o: torch.Tensor, group: dict, scale: float, skip: torch.Tensor | None) -> None:
        """p <- p * (1 - lr * weight_decay) - lr * scale * o (decoupled weight decay, then the update); left as
        it is where `skip` is true."""
        new = p if skip is None else p.clone()
        if group["weight_decay"]:
            new.mul_(1 - group["lr"] * group["weight_decay"])
        new.add_(o.to(p.dtype), alpha=-group["lr"] * scale)
        if skip is not None:
            torch.where(skip, p, new, out=p)


PAD_MAX_ELEMENTS = 1 << 17  # matrices up to this size: per-call overhead outweighs the FLOPs padding adds


def newton_schulz_stacks(shapes: list[tuple[int, int]]) -> list[tuple[list[int], tuple[int, int]]]:
    """How to batch Newton-Schulz over matrices of these shapes: [(indices, (rows, cols) of the stack)].

    Newton-Schulz runs on the wide orientation (rows <= cols), so a (4C, C) and a (C, 4C) matrix share a stack.
    Small matrices all go into one stack, zero-padded to the largest: padding is exact (zero rows and columns
    stay zero and add nothing to the norm or the products) and one call beats one per shape, whose tiny
    matmuls are mostly overhead (speedrun model: 1.5 vs 2.3 ms per step). Larger ones stack by shape, where
    padding would cost real FLOPs."""
    wide = [(min(s), max(s)) for s in shapes]
    if max(r * c for r, c in wide) <= PAD_MAX_ELEMENTS:
        return [(list(range(len(wide))), (max(r for r, _ in wide), max(c for _, c in wide)))]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(wide):
        by_shape.setdefault(shape, []).append(i)
    return [(idx, shape) for shape, idx in by_shape.items()]


def newton_schulz(g: torch.Tensor, steps: int, coefficients: tuple[float, float, float], eps: float) -> torch.Tensor:
    """Approximately orthogonalize every matrix of a (batch, rows, cols) stack, in bf16 like torch.optim.Muon.

    On a CPU without bf16 matmul units (AVX2 only: torch's bf16 matmuls run 10-20x slower than fp32 there) each
    product is computed in fp32 and rounded to bf16 once, which is what a bf16 matmul computes (fp32
    accumulation, one rounding), at fp32 speed."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    work = torch.float32 if x.device.type == "cpu" and not native_low_precision_matmul(torch.bfloat16) else x.dtype
    x = x.to(work)
    for _ in range(steps):
        gram = (x @ x.mT).bfloat16().to(work)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c).bfloat16().to(work)
        x = torch.baddbmm(x, update, x, beta=a).bfloat16().to(work)
    x = x.bfloat16()
    return x.mT if tall else x


def torch_muon() -> type:
    """torch.optim.Muon, or a one-line error on a torch older than 2.9 (a CUDA wheel from an older index can
    be installed beside pyproject's floor): said before the first step, not as an AttributeError mid-setup."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise GptlabError(f"optimizer_impl \"torch\" with optimizer muon needs torch >= 2.9 (torch.optim.Muon), this "
                          f"is torch {torch.__version__}: upgrade torch, or set optimizer_impl = \"gptlab\"")
    return muon


def build_optimizers(model: torch.nn.Module, spec: OptimizerSpec) -> list:
    """The optimizers for `model`'s trainable parameters (a plain GPT, or one with frozen parts).

    The parameters come from the model's own grouping (`parameter_groups_by_kind`, `optimizer_groups`), which
    leaves frozen ones out. Each param group records its peak lr in `peak_lr`, which `set_lr` scales.
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
                optimizers.append(BatchedMuon(matrices, **kwargs))
            else:  # "original" scales lr by sqrt(max(1, rows/cols)) per matrix, as Keller Jordan's Muon does
                optimizers.append(torch_muon()(matrices, **kwargs, adjust_lr_fn="original"))
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


def step_optimizers(optimizers: list, skip: torch.Tensor | None = None) -> None:
    """Step every optimizer, unless `skip` (a 0-dim bool tensor) is true: then neither the weights nor the
    optimizer state change. Optimizers that take `found_inf` decide on the device, so the host never waits for
    the step's loss; others (torch.optim.Muon, unfused AdamW) cost one read of `skip`, as GradScaler reads
    found_inf for them."""
    found_inf, host_skip = (None if skip is None else skip.float()), None
    for opt in optimizers:
        if found_inf is None:
            opt.step()
        elif takes_found_inf(opt):
            opt.found_inf = found_inf
            try:
                opt.step()
            finally:
                del opt.found_inf
        else:
            if host_skip is None:
                host_skip = bool(skip)
            if not host_skip:
                opt.step()
