"""Hook points: named activations of any gptlab model that a caller may read or replace during a forward.

The names are TransformerLens' (the table in README.md, "Looking inside"): `hook_embed`, `hook_pos_embed`,
`blocks.{i}.hook_resid_pre | hook_attn_out | hook_resid_mid | hook_mlp_out | hook_resid_post`,
`blocks.{i}.attn.hook_q | hook_k | hook_v | hook_rot_q | hook_rot_k | hook_attn_scores | hook_pattern | hook_z`,
`blocks.{i}.mlp.hook_pre | hook_pre_linear | hook_post`, `ln_final.hook_normalized` and `hook_logits`; which of
them a model has follows from its config (`hook_point_names`).

The model's modules each carry a `hooks` attribute, None unless `hooked` sets it for the length of a `with`:
a forward with none set runs exactly as before (fused attention, the lean and native decode steps, CUDA graphs).
Only a hook on the attention scores or pattern sends that layer through the manual attention path, which
computes them. A hook runs only on the thread that set it (a server's other requests use the same model), and
another thread's forwards and decode steps take their fast paths as if none were set (`hooked_here`).
"""

from __future__ import annotations

import contextlib
import difflib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

import torch
import torch.nn as nn

from gptlab.errors import GptlabError
from gptlab.hardware import resolve_device, weights_dtype
from gptlab.model import GPT

M = TypeVar("M", bound=nn.Module)

HookFn = Callable[[torch.Tensor], "torch.Tensor | None"]

MODEL_POINTS = ("hook_embed", "hook_pos_embed", "ln_final.hook_normalized", "hook_logits")
BLOCK_POINTS = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
ATTENTION_POINTS = ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_attn_scores", "hook_pattern",
                    "hook_z")
MLP_POINTS = ("hook_pre", "hook_pre_linear", "hook_post")
PATTERN_POINTS = ("hook_attn_scores", "hook_pattern")  # only the manual attention path computes these


def _layer_points(model: GPT) -> dict[str, tuple[str, ...]]:
    """The points of one layer's block, attention and MLP that this model's config has."""
    cfg = model.config
    block = tuple(p for p in BLOCK_POINTS if not (p == "hook_resid_mid" and cfg.block == "parallel"))
    attn = tuple(p for p in ATTENTION_POINTS if "rot" not in p or cfg.position == "rope")
    mlp = tuple(p for p in MLP_POINTS if p != "hook_pre_linear" or cfg.gated_mlp)
    return {"": block, "attn.": attn, "mlp.": mlp}


def hook_point_names(model: GPT) -> list[str]:
    """Every hook point of `model`, in the order a forward reaches them (per layer: block, attention, MLP)."""
    cfg = model.config
    names = [p for p in MODEL_POINTS[:2] if p != "hook_pos_embed" or cfg.position == "learned"]
    layer = _layer_points(model)
    for i in range(cfg.n_layer):
        names += [f"blocks.{i}.{part}{p}" for part, points in layer.items() for p in points]
    return names + list(MODEL_POINTS[2:])


def check_names(model: GPT, names: Iterable[str] | str) -> list[str]:
    """`names` as a list, each a hook point of `model`; else a one-line error naming it (and the nearest one)."""
    known = set(hook_point_names(model))
    names = [names] if isinstance(names, str) else list(names)  # one name, not its characters
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise GptlabError(f"{name!r} is not a hook point of this model{hint}; gptlab.hooks.hook_point_names "
                              "lists them")
    return names


_LOCK = threading.Lock()  # every model's registry is made, changed and dropped under it


class _Registry:
    """A model's hook functions, per thread (a stack of `hooked` frames each). While any thread has some, every
    hook-carrying module's `hooks` is a `_Points` reading them; when the last frame leaves, the attributes and the
    registry go (the forward's fast paths come back, and a hook-free model deep-copies as before)."""

    def __init__(self, model: GPT) -> None:
        self.model = model
        self.frames: dict[int, list[Mapping[str, HookFn]]] = {}

    @staticmethod
    def push(model: GPT, fns: Mapping[str, HookFn]) -> None:
        with _LOCK:
            registry = model.__dict__.setdefault("_hook_registry", _Registry(model))
            registry.frames.setdefault(threading.get_ident(), []).append(fns)
            registry._update()

    @staticmethod
    def pop(model: GPT, fns: Mapping[str, HookFn]) -> None:
        with _LOCK:
            registry = model.__dict__["_hook_registry"]
            me = threading.get_ident()
            stack = registry.frames[me]
            del stack[next(i for i, f in enumerate(stack) if f is fns)]
            if not stack:
                del registry.frames[me]
            registry._update()
            if not registry.frames:
                del model.__dict__["_hook_registry"]

    def _update(self) -> None:
        for prefix, module in _modules(self.model):
            if not self.frames:
                module.__dict__.pop("hooks", None)
                module.__dict__.pop("needs_pattern", None)
                continue
            if "hooks" not in module.__dict__:
                module.hooks = _Points(prefix, self)
            if prefix.endswith("attn.") and "needs_pattern" not in module.__dict__:
                module.needs_pattern = _PatternWanted(prefix, self)

    def wanted_here(self) -> set[str]:
        """The hook point names the calling thread's frames set."""
        return {name for fns in self.frames.get(threading.get_ident(), ()) for name in fns}


class _PatternWanted:
    """An attention module's `needs_pattern`, true on the threads whose hooks read its scores or pattern: another
    thread's forwards keep the fused attention, and its numbers."""

    def __init__(self, prefix: str, registry: _Registry) -> None:
        self.prefix, self.registry = prefix, registry

    def __bool__(self) -> bool:
        wanted = self.registry.wanted_here()
        return any(self.prefix + p in wanted for p in PATTERN_POINTS)


class _Points:
    """One module's hook points: `points(name, x)` runs the calling thread's functions at prefix + name, outer
    `hooked` frames first. A function returns its activation's replacement, or None to leave it."""

    def __init__(self, prefix: str, registry: _Registry) -> None:
        self.prefix, self.registry = prefix, registry

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        full = self.prefix + name
        for fns in self.registry.frames.get(threading.get_ident(), ()):
            fn = fns.get(full)
            out = None if fn is None else fn(x)
            if out is None:
                continue
            if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise GptlabError(f"the hook at {full} returned {got}: it must return None or a tensor of the "
                                  f"activation's shape {tuple(x.shape)}")
            x = out
        return x


def hooked_here(model: nn.Module) -> bool:
    """Whether the calling thread has hooks set on `model` (then its forwards take the plain path, where they run;
    another thread's hooks leave this one's fast paths as they are)."""
    registry = model.__dict__.get("_hook_registry")
    return registry is not None and bool(registry.frames.get(threading.get_ident()))


def _modules(model: GPT) -> Iterator[tuple[str, nn.Module]]:
    """Each module that carries hook points, with its names' prefix."""
    yield "", model
    for i, block in enumerate(model.transformer.h):
        yield f"blocks.{i}.", block
        yield f"blocks.{i}.attn.", block.attn
        yield f"blocks.{i}.mlp.", block.mlp


@contextlib.contextmanager
def hooked(model: GPT, fns: Mapping[str, HookFn]) -> Iterator[GPT]:
    """Within the `with`, each function in `fns` (hook point name -> fn(activation) -> replacement or None)
    runs at its point in every forward of `model` on this thread. They are removed on leaving, also when the
    body raises; other threads' hooks (each thread sees only its own) are left alone."""
    check_names(model, fns)
    frame = dict(fns)
    _Registry.push(model, frame)
    try:
        yield model
    finally:
        _Registry.pop(model, frame)


def as_batch(model: GPT, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Token ids as a (B, T) tensor on the model's device: a list or a (T,) tensor is one row."""
    idx = torch.as_tensor(idx)
    if idx.dim() == 1:
        idx = idx[None]
    return idx.to(next(model.parameters()).device)


@contextlib.contextmanager
def eval_mode(model: M) -> Iterator[M]:
    """The model in eval mode (dropout off) within the `with`, its own mode given back after, also when the block
    raises: a training model left in eval mode by a failed evaluation would train on without dropout."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def run_with_hooks(model: GPT, idx: torch.Tensor | Sequence[int], fns: Mapping[str, HookFn]) -> torch.Tensor:
    """The logits (B, T, vocab) of one forward (in eval mode) with `fns` at their hook points (see `hooked`)."""
    with eval_mode(model), hooked(model, fns):
        logits, _ = model(as_batch(model, idx))
    return logits


@torch.no_grad()
def run_with_cache(
    model: GPT,
    idx: torch.Tensor | Sequence[int],
    names: Iterable[str] | str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(logits, cache): one forward's activations at `names` (default every hook point; a string is one name),
    each moved to `device` / cast to `dtype` (a floating-point dtype or its name) when given. Shapes: residual
    points (B, T, C); q/k/v/z (B, T, heads, hs); scores and pattern (B, nh, T, T_k); MLP points (B, T, hidden)."""
    names = hook_point_names(model) if names is None else check_names(model, names)
    # checked before the forward: else torch's own error from inside the first hook, CUDA's an AssertionError
    device = None if device is None else resolve_device(str(device), flag="device")
    dtype = weights_dtype(dtype)
    cache: dict[str, torch.Tensor] = {}

    def keep(name: str) -> HookFn:
        def store(x: torch.Tensor) -> None:
            cache[name] = x.detach().to(device=device, dtype=dtype)
        return store

    logits = run_with_hooks(model, idx, {name: keep(name) for name in names})
    return logits, cache
