"""Steering: a direction added to the residual stream as it enters a layer (`blocks.{layer}.hook_resid_pre`),
at every position, while the model generates.

A direction comes from a safetensors file holding one vector of the model's width (`load_steering`; written by
`save_direction`), or from contrasting prompts (`direction_from_prompts`: the mean residual stream over the
positive prompts minus that over the negative ones, each prompt averaged over its positions). `steered(model,
vectors)` applies them for the length of a `with`; `gptlab.generate(..., steering=[...])` and `gptlab sample
--steer FILE:LAYER:SCALE` do it for a generation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_file, safetensors_problem
from gptlab.hooks import HookFn, hooked, run_with_cache
from gptlab.model import GPT

DIRECTION_KEY = "direction"


@dataclass(frozen=True)
class SteeringVector:
    """`scale * direction` (a (n_embd,) tensor) added to the residual stream entering block `layer`."""

    direction: torch.Tensor
    layer: int
    scale: float = 1.0

    def check(self, model: GPT) -> None:
        cfg = model.config
        if not 0 <= self.layer < cfg.n_layer:
            raise GptlabError(f"steering layer {self.layer} is out of range: this model has layers "
                              f"0..{cfg.n_layer - 1}")
        if tuple(self.direction.shape) != (cfg.n_embd,):
            raise GptlabError(f"a steering direction must have the model's width ({cfg.n_embd},), got "
                              f"{tuple(self.direction.shape)}")
        if not bool(torch.isfinite(self.direction).all()):
            raise GptlabError("a steering direction holds a NaN or an infinity")
        # a NaN or infinite scale (or one that overflows the direction) would turn every logit into NaN
        if not math.isfinite(self.scale) or not bool(torch.isfinite(self.scale * self.direction.float()).all()):
            raise GptlabError(f"steering scale {self.scale} is not finite, or makes the direction overflow: pass "
                              "a finite scale")


def load_direction(path: str | Path) -> torch.Tensor:
    """The one vector in a safetensors file (or its tensor named "direction"), as float32: never unpickled."""
    from safetensors.torch import load_file

    path = Path(path)
    problem = safetensors_problem(path)
    if problem:
        raise GptlabError(f"steering file: {problem}")
    tensors = load_file(path)
    if DIRECTION_KEY in tensors:
        direction = tensors[DIRECTION_KEY]
    elif len(tensors) == 1:
        direction = next(iter(tensors.values()))
    else:
        raise GptlabError(f"{path}: a steering file holds one tensor (or one named {DIRECTION_KEY!r}); this one has "
                          f"{len(tensors)}")
    if direction.dim() != 1 or not direction.is_floating_point():
        raise GptlabError(f"{path}: the steering direction must be a vector of floats, got shape "
                          f"{tuple(direction.shape)} of {direction.dtype}")
    return direction.float()


def load_steering(path: str | Path, layer: int, scale: float = 1.0) -> SteeringVector:
    return SteeringVector(load_direction(path), layer, scale)


def save_direction(path: str | Path, direction: torch.Tensor) -> Path:
    """Write a direction as `load_direction` reads it, atomically."""
    from safetensors.torch import save_file

    tensor = direction.detach().float().cpu().contiguous()
    return atomic_write_file(path, lambda tmp: save_file({DIRECTION_KEY: tensor}, str(tmp)))


def direction_from_prompts(
    model: GPT, positive: Sequence[Sequence[int]], negative: Sequence[Sequence[int]], layer: int
) -> torch.Tensor:
    """mean(residual stream entering `layer` over the positive prompts) - mean(over the negative ones), each
    prompt's stream averaged over its positions first (prompts may differ in length). (n_embd,) float32."""
    if not positive or not negative:
        raise GptlabError("a steering direction from prompts needs at least one positive and one negative prompt")
    SteeringVector(torch.zeros(model.config.n_embd), layer).check(model)
    name = resid_pre(layer)

    def mean_stream(prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        rows = [run_with_cache(model, list(p), [name], device="cpu", dtype=torch.float32)[1][name][0].mean(0)
                for p in prompts]
        return torch.stack(rows).mean(0)

    return mean_stream(positive) - mean_stream(negative)


def layer_totals(vectors: Sequence[SteeringVector]) -> dict[int, torch.Tensor]:
    """Each steered layer's sum of `scale * direction` (float32), in the vectors' order; the one sum that whole
    forwards (`steered`) and the engine's rows (`generation.row_steering`) add."""
    totals: dict[int, torch.Tensor] = {}
    for v in vectors:
        totals[v.layer] = totals.get(v.layer, 0) + v.scale * v.direction.float()
    return totals


def resid_pre(layer: int) -> str:
    """The hook point a steering vector of `layer` is added at."""
    return f"blocks.{layer}.hook_resid_pre"


def _adder(total: torch.Tensor) -> HookFn:
    def add(x: torch.Tensor) -> torch.Tensor:
        return x + total.to(device=x.device, dtype=x.dtype)
    return add


def check_vectors(model: GPT, vectors: Sequence[SteeringVector]) -> tuple[SteeringVector, ...]:
    """The vectors as a tuple, each checked against `model` (layer in range, the model's width, finite)."""
    if not isinstance(vectors, Sequence) or not all(isinstance(v, SteeringVector) for v in vectors):
        raise GptlabError(f"steering must be a sequence of SteeringVector, got {vectors!r:.80}")
    for v in vectors:
        v.check(model)
    return tuple(vectors)


@contextlib.contextmanager
def steered(model: GPT, vectors: Sequence[SteeringVector]) -> Iterator[GPT]:
    """Within the `with`, every forward of `model` (on this thread) adds the vectors to the residual stream. No
    vectors: nothing is set (the fast decode paths stay)."""
    if not vectors:
        yield model
        return
    totals = layer_totals(check_vectors(model, vectors))
    with hooked(model, {resid_pre(layer): _adder(total) for layer, total in totals.items()}):
        yield model
