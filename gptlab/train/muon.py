"""Muon for the hidden weight matrices: `BatchedMuon` (optimizer_impl "gptlab") and torch.optim.Muon ("torch").
"""

from __future__ import annotations

import math

import torch

from gptlab.errors import GptlabError
from gptlab.ops import native_low_precision_matmul
from gptlab.train.lean import LeanOptimizer


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
