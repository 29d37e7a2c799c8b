"""Muon for the hidden weight matrices: `BatchedMuon` (optimizer_impl "gptlab") and torch.optim.Muon ("torch"),
and their Newton-Schulz split over the processes of a DDP run.

Under DDP every process holds the same gradients (all-reduced) and so would orthogonalize every matrix to the same
result: the whole Newton-Schulz work repeated on every GPU. Split instead, as nanochat and modded-nanogpt do:
- `matrix_owners` gives each matrix to one process, a balanced assignment by Newton-Schulz FLOPs computed from the
  shapes alone, so every process computes the same one without talking;
- each process orthogonalizes the momentum-updated matrices it owns, and one all_gather (`share_updates`) hands
  everyone every bf16 update, so each process applies the same bits to its replica (DDP never re-syncs weights);
- the momentum buffers stay whole on every process (an elementwise update, cheap), so rank 0's checkpoint holds
  them all, as one process's does, and a run resumes on any number of processes.
`BatchedMuon(rank=, world=)` stacks only its own matrices, at the padded shapes one process would use;
`split_torch_muon()` is torch.optim.Muon with the same split. Both take the split only with world > 1.
"""

from __future__ import annotations

import functools
import math
from typing import Any

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
    weight decay. (torch's "momentum_buffer" is an average: (1 - momentum) times this one (torch 2.13, by lerp);
    Newton-Schulz normalizes the scale away, so the updates agree up to bf16 rounding, but the buffers of one
    implementation are not the other's: optimizer_impl may not change on resume.)
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
        *,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.rank, self.world = rank, world  # Newton-Schulz of this process's share of the matrices only
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps)
        super().__init__(params, defaults)
        if any(p.ndim != 2 for group in self.param_groups for p in group["params"]):
            raise ValueError("Muon only takes 2-D weight matrices")
        self._layouts: dict[tuple, StackLayout] = {}  # small stacks' buffers, kept from step to step

    def _layout(self, idx: list[int], shapes: list[torch.Size], shape: tuple[int, int],
                like: torch.Tensor) -> StackLayout:
        """The buffers of the stack of matrices `idx`: kept for a stack of up to KEEP_MAX_ELEMENTS (a small
        model's, whose step is mostly the per-matrix calls these views save), made again each step for a larger
        one (whose buffers would hold another copy of the weights between steps)."""
        key = (tuple(idx), tuple(tuple(shapes[i]) for i in idx), shape, like.dtype, like.device)
        layout = self._layouts.get(key)
        if layout is None:
            out_dtype = like.dtype if self.world == 1 else torch.bfloat16  # (bf16 updates travel between processes)
            layout = StackLayout([shapes[i] for i in idx], shape, like, out_dtype)
            if layout.wide.numel() <= KEEP_MAX_ELEMENTS:
                self._layouts[key] = layout
        return layout

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
            shapes = [p.shape for p in params]
            stacks = newton_schulz_stacks(shapes)  # the stacks of one process, so the padding is the same
            owners = matrix_owners(_stack_costs(stacks, len(params)), self.world)
            # without weight decay a skipped step is a zero update (p + (-lr) * 0 is p, bit for bit): one select
            # over each stack rather than a copy and a select per matrix
            zero_skipped = skip is not None and not group["weight_decay"]
            owned = {}
            for idx, shape in stacks:
                idx = [i for i in idx if owners[i] == self.rank]
                if not idx:
                    continue
                # the stack's updates written straight into its padded input: g + momentum * B (Nesterov) or B
                layout = self._layout(idx, shapes, shape, params[0])
                torch._foreach_copy_(layout.inputs, [grads[i] if group["nesterov"] else bufs[i] for i in idx])
                if group["nesterov"]:
                    torch._foreach_add_(layout.inputs, [bufs[i] for i in idx], alpha=mu)
                ortho = newton_schulz(layout.wide, group["ns_steps"], group["ns_coefficients"], group["eps"])
                # the updates' cast to the weights' dtype (exact; bf16 kept to share them between processes)
                layout.out.copy_(torch.where(skip, 0.0, ortho) if zero_skipped else ortho)
                owned.update(zip(idx, layout.outputs, strict=True))
            shared = share_updates(owned, owners, shapes, self.world, params[0].device)
            if skip is None or zero_skipped:
                _apply_updates(params, [o.to(p.dtype) for p, o in zip(params, shared, strict=True)], group)
            else:
                for p, o in zip(params, shared, strict=True):
                    new = p.clone()
                    _apply_updates([new], [o.to(p.dtype)], group)
                    torch.where(skip, p, new, out=p)


class StackLayout:
    """A stack's zero-padded Newton-Schulz input (`wide`, in the weights' dtype) and its output (`out`: the weights'
    dtype, bf16 where the updates travel between processes), with each matrix's view into both, oriented as the
    matrix (a tall one's transposed: Newton-Schulz runs on the wide orientation). Only the views are ever written,
    so the padding stays zero."""

    def __init__(self, shapes: list[torch.Size], shape: tuple[int, int], like: torch.Tensor,
                 out_dtype: torch.dtype) -> None:
        self.wide = like.new_zeros(len(shapes), *shape)
        self.out = like.new_zeros(len(shapes), *shape, dtype=out_dtype)
        self.inputs, self.outputs = self._views(self.wide, shapes), self._views(self.out, shapes)

    @staticmethod
    def _views(stack: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
        views = []
        for j, (rows, cols) in enumerate(shapes):
            v = stack[j, : min(rows, cols), : max(rows, cols)]
            views.append(v.mT if rows > cols else v)
        return views


# elements of a stack whose buffers BatchedMuon keeps between steps (16 MB in fp32): a small model's matrices
KEEP_MAX_ELEMENTS = 1 << 22


def _apply_updates(params: list[torch.Tensor], updates: list[torch.Tensor], group: dict) -> None:
    """p <- p * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * o (decoupled weight decay, then the
    update): one foreach call per distinct scale (a model's matrices have a few shapes), each the per-tensor
    `add_` it stands for."""
    lr, decay = group["lr"], group["weight_decay"]
    if decay:
        torch._foreach_mul_(params, 1 - lr * decay)
    by_scale: dict[float, list[int]] = {}
    for i, p in enumerate(params):
        by_scale.setdefault(math.sqrt(max(1.0, p.size(0) / p.size(1))), []).append(i)
    for scale, idx in by_scale.items():
        torch._foreach_add_([params[i] for i in idx], [updates[i] for i in idx], alpha=-lr * scale)


PAD_MAX_ELEMENTS = 1 << 17  # matrices up to this size: per-call overhead outweighs the FLOPs padding adds


def newton_schulz_stacks(shapes: list[tuple[int, int]]) -> list[tuple[list[int], tuple[int, int]]]:
    """How to batch Newton-Schulz over matrices of these shapes: [(indices, (rows, cols) of the stack)].

    Newton-Schulz runs on the wide orientation (rows <= cols), so a (4C, C) and a (C, 4C) matrix share a stack.
    Small matrices all go into one stack, zero-padded to the largest: padding is exact (zero rows and columns
    stay zero and add nothing to the norm or the products) and one call beats one per shape, whose tiny
    matmuls are mostly overhead (the speedrun model's step is measurably shorter so). Larger ones stack by shape, where
    padding would cost real FLOPs."""
    wide = [(min(s), max(s)) for s in shapes]
    if max(r * c for r, c in wide) <= PAD_MAX_ELEMENTS:
        return [(list(range(len(wide))), (max(r for r, _ in wide), max(c for _, c in wide)))]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(wide):
        by_shape.setdefault(shape, []).append(i)
    return [(idx, shape) for shape, idx in by_shape.items()]


def newton_schulz(g: torch.Tensor, steps: int, coefficients: tuple[float, float, float], eps: float) -> torch.Tensor:
    """Approximately orthogonalize every matrix of a (batch, rows, cols) stack; the result in bf16, like
    torch.optim.Muon's.

    Where the device multiplies bf16 natively the iteration runs in bf16 as torch's does (a stack of small
    matrices on a CPU with bf16 dot products: the whole iteration in one call of gptlab's kernel, `_native_ops`,
    with the same roundings). On a CPU without bf16 matmul units (AVX2 only: torch's bf16 matmuls run 10-20x
    slower than fp32 there) it runs in fp32 (`newton_schulz_fp32`): nearer the exact iteration than bf16's, and
    faster."""
    a, b, c = coefficients
    in_fp32 = g.device.type == "cpu" and not native_low_precision_matmul(torch.bfloat16)
    x = g.float() if in_fp32 else g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    if in_fp32:
        x = newton_schulz_fp32(x, steps, coefficients).bfloat16()
        return x.mT if tall else x
    ops = _native_ops(x)
    if ops is not None:  # the whole iteration in one C++ call, the same roundings
        x = ops.newton_schulz(x.contiguous(), steps, a, b, c)
        return x.mT if tall else x
    x = newton_schulz_steps(x, steps, coefficients)
    return x.mT if tall else x


def newton_schulz_fp32(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float],
                       form: str = "auto") -> torch.Tensor:
    """`steps` Newton-Schulz steps X <- a X + (b A + c A^2) X, A = X X^T, over a (batch, r, c) stack of wide (r <= c),
    normalized fp32 matrices.

    form "gram" runs the iteration on r x r matrices only: every X_k is P_k X_0 with P_k a polynomial in A_0, so
    with M_k = a I + b A_k + c A_k^2 (which commutes with A_k), X_k+1 = M_k X_k and A_k+1 = M_k A_k M_k, and
    X_steps = (M_steps-1 ... M_0) X_0. Two products with the long side (A_0, and the last) instead of two per
    step: (4 steps - 3) r^3 + 2 r^2 c multiply-adds against steps (2 r^2 c + r^3), fewer where c > 1.5 r, as
    Muon's matrices mostly are (an MLP's 1 x 4, the fused qkv's 1 x 3). In fp32 the squared condition number of
    A costs nothing that matters: the small singular values, which A's rounding hides, are those the iteration
    only scales by about a^steps, and the result is rounded to bf16 anyway (in bf16 they would be lost: this runs
    in fp32 only).
    "standard" is the iteration as written; "auto" takes the one with fewer multiply-adds."""
    a, b, c = coefficients
    r, cols = x.shape[-2:]
    if form == "auto":
        form = "gram" if steps > 1 and 2 * cols > 3 * r else "standard"
    if form == "standard":
        return newton_schulz_steps(x, steps, coefficients)
    gram, product = x @ x.mT, None  # A_k, and M_k-1 ... M_0
    for k in range(steps):
        m = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        m.diagonal(dim1=-2, dim2=-1).add_(a)
        product = m if product is None else m @ product
        if k + 1 < steps:
            gram = m @ gram @ m
    return x if product is None else product @ x


def newton_schulz_steps(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """The iteration as written, in x's dtype: `steps` times X <- a X + (b A + c A^2) X with A = X X^T."""
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


# the largest matrix (rows x cols) whose Newton-Schulz the C++ kernel runs faster than ATen's bf16 products in
# both builds (5 steps, 2 threads, AMX Xeon: 8 x 64 x 256 0.53 ms on AMX tiles, 1.41 with AVX512-BF16, 1.62
# through ATen; 8 x 32 x 128 0.14 / 0.24 / 0.92; at 8 x 128 x 256 AVX512-BF16 is 2.2x slower than ATen)
NATIVE_MAX_ELEMENTS = 64 * 256


def _native_ops(x: torch.Tensor) -> Any | None:
    """gptlab's kernels where they run this stack's iteration (`kernels/newton_schulz.cpp`): a bf16 stack of
    matrices up to NATIVE_MAX_ELEMENTS on a CPU with bf16 dot products, outside torch.compile; else None (ATen's
    products run)."""
    if (x.device.type != "cpu" or x.dim() != 3 or x.size(-2) * x.size(-1) > NATIVE_MAX_ELEMENTS
            or torch.compiler.is_compiling()):
        return None
    from gptlab.kernels import bf16_dot_ops

    return bf16_dot_ops()


def torch_muon() -> type:
    """torch.optim.Muon, or a one-line error on a torch older than 2.9 (a CUDA wheel from an older index can
    be installed beside pyproject's floor): said before the first step, not as an AttributeError mid-setup."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise GptlabError(f"optimizer_impl \"torch\" with optimizer muon needs torch >= 2.9 (torch.optim.Muon), this "
                          f"is torch {torch.__version__}: upgrade torch, or set optimizer_impl = \"gptlab\"")
    return muon


@functools.cache
def split_torch_muon() -> type:
    """torch.optim.Muon whose step orthogonalizes only this process's share of the matrices (`rank`, `world`
    keywords) and gathers the rest. The step is torch's own per-matrix loop (torch 2.13's `_single_tensor_muon`:
    momentum by lerp, torch's `_zeropower_via_newtonschulz` and `_adjust_lr`) in two passes around the gather:
    bit-identical to torch.optim.Muon (test_split_torch_muon_is_torch_muon pins it, so a torch that changes its
    loop fails there). The class is named Muon, as torch's: checkpoints record the optimizer's class name, and
    a run resumes on one process or many."""
    from torch.optim import _muon

    class Muon(torch_muon()):
        def __init__(self, params, *, rank: int = 0, world: int = 1, **kwargs) -> None:  # noqa: ANN001
            super().__init__(params, **kwargs)
            self.rank, self.world = rank, world

        @torch.no_grad()
        def step(self, closure=None) -> None:  # noqa: ANN001 - torch's signature; gptlab passes no closure
            if closure is not None:
                raise ValueError("this Muon takes no closure")
            for group in self.param_groups:
                params: list[torch.Tensor] = []
                grads: list[torch.Tensor] = []
                bufs: list[torch.Tensor] = []
                self._init_group(group, params, grads, bufs)
                if not params:
                    continue
                momentum, shapes = group["momentum"], [p.shape for p in params]
                owners = matrix_owners([newton_schulz_cost(*s) for s in shapes], self.world)
                owned = {}
                for i, (grad, buf) in enumerate(zip(grads, bufs, strict=True)):
                    buf.lerp_(grad, 1 - momentum)  # every process: the buffers stay whole everywhere
                    if owners[i] == self.rank:
                        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                        owned[i] = _muon._zeropower_via_newtonschulz(update, group["ns_coefficients"],
                                                                     group["ns_steps"], group["eps"])
                lr = float(group["lr"])
                for p, update in zip(params, share_updates(owned, owners, shapes, self.world, params[0].device),
                                     strict=True):
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(update, alpha=-_muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    return Muon


# --- the split over processes ---------------------------------------------------------------------------------
def newton_schulz_cost(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton-Schulz step on a matrix (its wide orientation r x c, r <= c): X X^T (r r c),
    the Gram polynomial (r r r) and its product with X (r r c)."""
    r, c = min(rows, cols), max(rows, cols)
    return r * r * (2 * c + r)


def _stack_costs(stacks: list[tuple[list[int], tuple[int, int]]], n: int) -> list[int]:
    """Each matrix's cost at the padded shape of its stack (what its orthogonalization runs at)."""
    costs = [0] * n
    for idx, shape in stacks:
        for i in idx:
            costs[i] = newton_schulz_cost(*shape)
    return costs


def matrix_owners(costs: list[int], world: int) -> list[int]:
    """The process that orthogonalizes each matrix: the costliest first, each to the least loaded process so far
    (ties: the lowest rank), which keeps the busiest within one matrix of the mean. A pure function of the costs,
    so every process computes the same owners; alone, process 0 owns all."""
    owners, load = [0] * len(costs), [0] * world
    if world == 1:
        return owners
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i], load[rank] = rank, load[rank] + costs[i]
    return owners


def share_updates(owned: dict[int, torch.Tensor], owners: list[int], shapes: list[torch.Size], world: int,
                  device: torch.device) -> list[torch.Tensor]:
    """Every matrix's orthogonalized update (bf16) on every process, in the order of `owners`. `owned`: this
    process's own, by index. They travel as one buffer per process, its updates one after the other (padded to
    the largest share: all_gather takes equal sizes), in one all_gather; the owner, too, takes its updates from
    the gathered copy, so every process applies the same bits."""
    if world == 1:
        return [owned[i] for i in range(len(shapes))]
    import torch.distributed as dist

    sizes = [0] * world
    for i, rank in enumerate(owners):
        sizes[rank] += math.prod(shapes[i])
    mine = [owned[i].reshape(-1) for i in sorted(owned)]
    pad = max(sizes) - sum(t.numel() for t in mine)
    local = torch.cat([*mine, torch.zeros(pad, dtype=torch.bfloat16, device=device)])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    offsets, updates = [0] * world, []
    for i, rank in enumerate(owners):
        n = math.prod(shapes[i])
        updates.append(gathered[rank][offsets[rank] : offsets[rank] + n].view(shapes[i]))
        offsets[rank] += n
    return updates
