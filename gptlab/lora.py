"""LoRA: fine-tune a frozen model through low-rank updates of its linear layers.

A LoRA layer keeps the pretrained weight W frozen and learns two small matrices per target, A (r, in) and
B (out, r), so that the layer computes  y = x W^T + b + (alpha / r) * dropout(x) A^T B^T.  B starts at zero: before
the first step the model is exactly the base model. Only A and B train, so an optimizer holds a few MB of state
instead of three copies of the model, and a run's checkpoints hold only the adapters.

gptlab's attention computes q, k and v in one matmul (`c_attn`) and SwiGLU's gate and up in another (`c_fc`),
where Hugging Face models have one Linear each. A target name means the same thing here as there: "q" adapts
the q rows of `c_attn` only, with its own A and B, exactly as peft's adapter on `q_proj` does. The targeted
slices of one layer share a single matmul with their A matrices stacked: x (..., in) @ [A_q; A_k; A_v]^T.

`LoRALinear` subclasses `nn.Linear` and keeps its `weight` and `bias`, so a model with adapters still loads a
plain checkpoint by name, and the packed CPU inference kernels (which take only exact `nn.Linear`s) leave it
to its own forward. The adapters compute in their own dtype (fp32, the optimizer's master copy) whatever the
base runs in (bf16 or fp32), as peft does by default. On a CPU without bf16 matmul units (AVX2-only: torch's bf16
matmul there is 3-100x slower than fp32) a bf16 layer computes base and adapters together in fp32 and rounds once
(`_UpcastLoRA`); elsewhere the adapters keep their bf16 input, not an fp32 copy, for their gradient.

Names: `all-linear` is every target the architecture has (the LM head excluded, as in peft); Hugging Face
names (`q_proj`, `down_proj`, ...) are accepted for the short ones.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.linear import Linear
from gptlab.model import GPT
from gptlab.ops import upcasting_linear, upcasts

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ALIASES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
           "down_proj": "down"}
ALL_LINEAR = "all-linear"


class LoRAError(GptlabError):
    """A LoRA setting this model cannot take (an unknown target, a rank below 1)."""


@dataclass(frozen=True)
class LoRASpec:
    """Rank, scale (alpha / rank), dropout on the adapters' input, and the target names (see TARGETS)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    quantize: str | None = None  # QLoRA: the base's block Linears as int8 / int4 (`gptlab.qlora`)
    group_size: int | None = None  # int4's group size (None: quantize's default)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        d = {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}
        return d if self.quantize is None else {**d, "quantize": self.quantize, "group_size": self.group_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoRASpec:
        group = d.get("group_size")
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), dropout=float(d["dropout"]),
                   targets=tuple(d["targets"]), quantize=d.get("quantize"), group_size=None if group is None else
                   int(group))


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """"q,v" / ["q_proj", "v_proj"] / "all-linear" -> canonical names, in TARGETS order (LoRAError if unknown)."""
    given = targets.split(",") if isinstance(targets, str) else list(targets) if isinstance(targets, Iterable) else None
    if given is None or not all(isinstance(t, str) for t in given):
        raise LoRAError(f"lora_targets must be names ({', '.join(TARGETS)} or {ALL_LINEAR}), got {targets!r}")
    names = [t.strip() for t in given if t.strip()]
    if not names:
        raise LoRAError("lora_targets is empty: name some of " + ", ".join(TARGETS) + f" or {ALL_LINEAR}")
    if ALL_LINEAR in names:
        return (ALL_LINEAR,)
    canonical = set()
    for name in names:
        name = ALIASES.get(name, name)
        if name not in TARGETS:
            raise LoRAError(f"unknown LoRA target {name!r}: choose from {', '.join(TARGETS)} or {ALL_LINEAR}")
        canonical.add(name)
    return tuple(t for t in TARGETS if t in canonical)


def layer_slices(config: GPTConfig) -> dict[str, dict[str, tuple[int, int]]]:
    """For each adaptable Linear of a block (by its name inside the block): target name -> its output rows."""
    q = config.n_head * config.head_size
    kv = config.n_kv_head * config.head_size
    fc = {"gate": (0, config.hidden_size), "up": (config.hidden_size, 2 * config.hidden_size)} \
        if config.gated_mlp else {"up": (0, config.hidden_size)}
    return {
        "attn.c_attn": {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)},
        "attn.c_proj": {"o": (0, config.n_embd)},
        "mlp.c_fc": fc,
        "mlp.c_proj": {"down": (0, config.n_embd)},
    }


def resolve_targets(config: GPTConfig, targets: Iterable[str]) -> tuple[str, ...]:
    """The targets this architecture has (all-linear expanded); LoRAError for one it lacks (gate without SwiGLU)."""
    present = [t for slices in layer_slices(config).values() for t in slices]
    targets = tuple(targets)
    if targets == (ALL_LINEAR,):
        return tuple(t for t in TARGETS if t in present)
    missing = [t for t in targets if t not in present]
    if missing:
        raise LoRAError(f"LoRA target {missing[0]!r}: this model's MLP ({config.mlp}) has no gate projection; "
                        f"its targets are {', '.join(t for t in TARGETS if t in present)}")
    return targets


class LoRALinear(nn.Linear):
    """A frozen Linear plus one low-rank update per targeted slice of its output rows. The frozen layer is an
    `nn.Linear` (its weight and bias become this layer's) or a module computing x W^T + b from weights it holds
    otherwise, with a `dequantize()` giving W (QLoRA's quantized layers: `base_layer`, `weight` None)."""

    def __init__(self, base: nn.Module, slices: dict[str, tuple[int, int]], spec: LoRASpec,
                 dtype: torch.dtype = torch.float32) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.base_layer = None if isinstance(base, nn.Linear) else base
        if self.base_layer is None:
            self.weight = base.weight  # the same Parameters: nothing is copied
            self.register_parameter("bias", base.bias)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        for p in base.parameters():
            p.requires_grad_(False)
        self.slices = dict(slices)  # target -> (start, end) rows of the output
        self.rank, self.scaling = spec.rank, spec.scaling
        device = next(base.buffers(), None) if self.weight is None else self.weight
        device = device.device if device is not None else None
        self.lora_A = nn.ParameterDict({
            t: nn.Parameter(torch.empty(spec.rank, self.in_features, device=device, dtype=dtype)) for t in slices})
        self.lora_B = nn.ParameterDict({
            t: nn.Parameter(torch.zeros(end - start, spec.rank, device=device, dtype=dtype))
            for t, (start, end) in slices.items()})
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.reset_lora_parameters()
        # the output laid out as consecutive row ranges: (target or None for rows no adapter touches, size)
        bounds = sorted(slices.items(), key=lambda kv: kv[1][0])
        self._layout: list[tuple[str | None, int]] = []
        row = 0
        for t, (start, end) in bounds:
            if start > row:
                self._layout.append((None, start - row))
            self._layout.append((t, end - start))
            row = end
        if row < self.out_features:
            self._layout.append((None, self.out_features - row))

    def reset_lora_parameters(self) -> None:
        """A as nn.Linear initialises its weight (Kaiming-uniform), B zero: the update starts at exactly 0."""
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        for b in self.lora_B.values():
            nn.init.zeros_(b)

    adapters_off = False  # set by `adapters_disabled`: the base layer alone (a preference objective's reference)

    def frozen_output(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen layer's x W^T + b."""
        if self.base_layer is not None:
            return self.base_layer(x)
        return upcasting_linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapters_off:
            return self.frozen_output(x)
        a = next(iter(self.lora_A.values()))
        # every targeted slice's A in one matmul: (..., n_targets * r)
        a = torch.cat(list(self.lora_A.values())) if len(self.lora_A) > 1 else a
        h = self.lora_dropout(x)
        frozen = self.weight is not None and not self.weight.requires_grad and (
            self.bias is None or not self.bias.requires_grad)
        if frozen and a.dtype == torch.float32 and x.dtype == self.weight.dtype and upcasts(x, self.weight):
            spans = tuple(self.slices[t] for t in self.lora_A)
            return _UpcastLoRA.apply(x, h, self.weight, self.bias, a, spans, self.scaling, *self.lora_B.values())
        y = self.frozen_output(x)  # (..., out)
        z = F.linear(h, a) if h.dtype == a.dtype else _AdapterInput.apply(h, a)
        r, order = self.rank, list(self.lora_A)
        parts = []
        for t, size in self._layout:
            if t is None:
                parts.append(z.new_zeros(*z.shape[:-1], size))
            else:
                i = order.index(t)
                parts.append(F.linear(z[..., i * r : (i + 1) * r], self.lora_B[t]))
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y + (delta * self.scaling).to(y.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """The update as a dense (out, in) matrix in fp32: scaling * B @ A per slice, zero elsewhere."""
        device = next(iter(self.lora_A.values())).device
        delta = torch.zeros(self.out_features, self.in_features, dtype=torch.float32, device=device)
        for t, (start, end) in self.slices.items():
            delta[start:end] = self.scaling * (self.lora_B[t].float() @ self.lora_A[t].float())
        return delta

    def merged(self) -> nn.Linear:
        """A plain Linear (the model's own, `gptlab.linear.Linear`) computing the same function (the update
        folded into the weight, in its dtype; a quantized base's weight dequantized, in fp32)."""
        quantized = self.base_layer is not None
        weight = self.base_layer.dequantize() if quantized else self.weight
        bias = self.base_layer.bias if quantized else self.bias
        dtype = weight.dtype
        linear = Linear(self.in_features, self.out_features, bias=bias is not None, device=weight.device,
                        dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_((weight.float() + self.delta_weight()).to(dtype))
            if bias is not None:
                linear.bias.copy_(bias)
        return linear


class _UpcastLoRA(torch.autograd.Function):
    """A whole LoRALinear for a bf16/fp16 base on a CPU without native low-precision matmuls (see
    `gptlab.model.upcasts`), in fp32: x W^T + b + scaling * h A^T B^T per slice, accumulated in fp32 and rounded
    once. One conversion of x and of the output gradient each way instead of one per matmul, no delta tensor to
    scale, cast and add. Saves the adapters' input h in its own dtype and z = h A^T, as the separate path does.
    Inputs: x, h (= dropout(x), or x itself), weight, bias, stacked A, the output rows of each A's B, scaling, Bs."""

    @staticmethod
    def forward(ctx, x, h, weight, bias, a, spans, scaling, *bs):  # noqa: ANN001, ANN205
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast("cpu", enabled=False):
            x32 = x2.float()
            h32 = x32 if h is x else h.reshape(-1, h.shape[-1]).float()
            y = F.linear(x32, weight.float(), None if bias is None else bias.float())
            z = F.linear(h32, a)  # (N, n_targets * r)
            r = a.shape[0] // len(spans)
            for i, ((start, end), b) in enumerate(zip(spans, bs, strict=True)):
                y[:, start:end].addmm_(z[:, i * r : (i + 1) * r], b.T, alpha=scaling)
        ctx.save_for_backward(weight, a, h, z, *bs)
        ctx.spans, ctx.scaling, ctx.h_is_x, ctx.shape = spans, scaling, h is x, x.shape
        return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        weight, a, h, z, *bs = ctx.saved_tensors
        spans, scaling, shape = ctx.spans, ctx.scaling, ctx.shape
        needs = ctx.needs_input_grad
        r = a.shape[0] // len(spans)
        with torch.autocast("cpu", enabled=False):
            g = grad.reshape(-1, grad.shape[-1]).float()
            dz = g.new_empty(g.shape[0], a.shape[0])
            dbs = []
            for i, ((start, end), b) in enumerate(zip(spans, bs, strict=True)):
                gi = g[:, start:end]
                dz[:, i * r : (i + 1) * r] = gi @ b
                dbs.append(gi.T @ z[:, i * r : (i + 1) * r] * scaling if needs[7 + i] else None)
            dz.mul_(scaling)
            da = dz.T @ h.reshape(-1, h.shape[-1]).float() if needs[4] else None
            dx = dh = None
            if needs[0] or (needs[1] and not ctx.h_is_x):
                dx = g @ weight.float() if needs[0] else None
                if ctx.h_is_x:
                    dx.addmm_(dz, a)
                elif needs[1]:
                    dh = (dz @ a).to(h.dtype).view(shape)
                dx = dx.to(grad.dtype).view(shape) if dx is not None else None
        return dx, dh, None, None, da, None, None, *dbs


class _AdapterInput(torch.autograd.Function):
    """F.linear(x.to(a.dtype), a) for a low-precision x (the bf16 base's activations) and fp32 adapters A, saving x
    as it is for A's gradient instead of its fp32 copy: half the memory an adapter keeps per layer input."""

    @staticmethod
    def forward(ctx, x, a):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, a)
        ctx.x_dtype = x.dtype
        return F.linear(x.to(a.dtype), a)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, a = ctx.saved_tensors
        gx = (grad @ a).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        ga = None
        if ctx.needs_input_grad[1]:
            ga = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1]).to(a.dtype)
        return gx, ga


def _adaptable(model: GPT) -> Iterator[tuple[nn.Module, str, str]]:
    """(parent module, attribute, name inside the block) of every adaptable Linear of every block."""
    for block in model.iter_blocks():
        for inner in layer_slices(model.config):
            parent_name, attr = inner.split(".")
            yield getattr(block, parent_name), attr, inner


def add_lora(
    model: GPT, spec: LoRASpec, base: dict[str, str] | None = None, dtype: torch.dtype = torch.float32
) -> GPT:
    """Freeze every parameter of `model` and give its targeted Linears adapters (in place; returns the model).
    `base` ({"path", "sha256"}) says where the frozen weights come from: a checkpoint of the adapters records it.

    Adapters draw their A from torch's RNG: seed it first for a reproducible init."""
    if spec.rank < 1:
        raise LoRAError(f"lora_rank must be at least 1, got {spec.rank}")
    if has_lora(model):
        raise LoRAError("the model already has LoRA adapters")
    # named first: an unknown name (or a bare "q,v" string, iterated by character) was reported by
    # resolve_targets as a missing gate projection
    targets = set(resolve_targets(model.config, parse_targets(spec.targets)))
    for p in model.parameters():
        p.requires_grad_(False)
    slices_of = layer_slices(model.config)
    for parent, attr, inner in _adaptable(model):  # a rank past a layer's width adds nothing but memory
        for target, (start, end) in slices_of[inner].items():
            width = min(getattr(parent, attr).in_features, end - start)
            if target in targets and spec.rank > width:
                raise LoRAError(f"LoRA rank {spec.rank} is larger than the {target} layer's width {width}: at most "
                                f"{width}")
    for parent, attr, inner in _adaptable(model):
        wanted = {t: rows for t, rows in slices_of[inner].items() if t in targets}
        if wanted:
            setattr(parent, attr, LoRALinear(getattr(parent, attr), wanted, spec, dtype=dtype))
    model.lora_spec, model.lora_base = spec, base  # what a checkpoint of the adapters records
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapter skipped (the frozen weights are the reference a preference
    objective compares against, so no second copy of the model is kept); restored after it, also on error."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapters_off = True
    try:
        yield
    finally:
        for m in layers:
            m.adapters_off = False


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors, by their names in the model (`...c_attn.lora_A.q`)."""
    return {name: t for name, t in model.state_dict().items() if ".lora_A." in name or ".lora_B." in name}


def lora_parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]


def merge_lora(model: GPT) -> GPT:
    """Fold every adapter into its Linear (in place): the result is a plain GPT computing the same function."""
    for parent, attr, _ in _adaptable(model):
        layer = getattr(parent, attr)
        if isinstance(layer, LoRALinear):
            setattr(parent, attr, layer.merged())
    model.__dict__.pop("lora_spec", None)
    model.__dict__.pop("lora_base", None)
    return model
