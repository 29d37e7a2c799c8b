"""gptlab's own optimizers' base (`LeanOptimizer`) and AdamW through the fused kernel (`FusedAdamW`).

torch.optim imports torch._dynamo on first use: about a second of start-up, a fifth of a CPU speedrun. These
keep torch's state_dict format, so checkpoints move between optimizer_impl "torch" and "gptlab".
"""

from __future__ import annotations

import torch


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
