"""Steering per row of the engine's batch: each generation's own vectors (`Generation.steering`,
`gptlab.steering`) added to its row of the residual stream, so steered and unsteered requests share a batch.

Row i of a forward's batch is the engine's slot `first + i` (a decode step runs slots 0.., a prefill the slots from
its first). At each steered layer's `hook_resid_pre` the forward adds a (B, 1, C) tensor: the row's
`steering.layer_totals` (the sum `gptlab.steering.steered` adds to a whole forward), and exact zeros in the rows of
unsteered and idle slots, which therefore compute what they compute alone. With no steered row in the batch nothing
is set, and the decode step keeps its fast paths; with one, the step runs the plain forward, as any hook makes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from gptlab.hooks import HookFn, hooked
from gptlab.model import GPT
from gptlab.steering import layer_totals, resid_pre

if TYPE_CHECKING:
    from gptlab.generation.request import Generation


def any_steered(slots: Sequence[Generation | None]) -> bool:
    return any(g is not None and g.steering for g in slots)


def _row_deltas(slots: Sequence[Generation | None], width: int) -> dict[int, torch.Tensor]:
    """Each steered layer's (len(slots), 1, width) float32 additions, zero in the rows of unsteered slots."""
    deltas: dict[int, torch.Tensor] = {}
    for i, g in enumerate(slots):
        if g is None or not g.steering:
            continue
        for layer, total in layer_totals(g.steering).items():
            deltas.setdefault(layer, torch.zeros(len(slots), 1, width))[i, 0] = total
    return deltas


def _add_rows(delta: torch.Tensor, first: int) -> HookFn:
    def add(x: torch.Tensor) -> torch.Tensor:
        return x + delta[first : first + x.shape[0]].to(device=x.device, dtype=x.dtype)
    return add


@contextlib.contextmanager
def steering_rows(model: GPT, slots: Sequence[Generation | None], first: int = 0) -> Iterator[None]:
    """Within the `with`, a forward of `model` (on this thread) whose batch row i is `slots[first + i]` adds each
    row's steering vectors to that row alone. No steered slot: nothing is set."""
    if not any_steered(slots):
        yield
        return
    deltas = _row_deltas(slots, model.config.n_embd)
    with hooked(model, {resid_pre(layer): _add_rows(delta, first) for layer, delta in deltas.items()}):
        yield
