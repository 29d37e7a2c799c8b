"""Steering requests: a request's `steering` entries ({"vector": NAME, "layer": L, "scale": s}) turned into
`gptlab.steering.SteeringVector`s over the directions the server was started with (`gptlab serve
--allow-steering NAME=FILE`, `create_app(steering={NAME: tensor or file})`).

Directions are named at start-up, never sent or named as files by a client: the operator decides which directions
a model may be pushed along (a steering vector can undo what the model was tuned to do), a request can read no
file of the server's, and each direction is checked once (the model's width, finite numbers). A server started
without any answers a request that asks for steering with a 400 naming the field. The engine steers each row alone
(`generation.row_steering`) and keeps steered rows out of the prefix cache.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Union

import torch

from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.serve.schemas import ApiError, SteeringEntry
from gptlab.steering import SteeringVector, load_direction

Direction = Union[torch.Tensor, str, "os.PathLike[str]"]


class SteeringDirections:
    """The named directions requests may steer with; `None`: steering is not allowed."""

    def __init__(self, model: GPT, directions: Mapping[str, Direction] | None) -> None:
        self.model = model
        self.directions: dict[str, torch.Tensor] | None = None
        if directions is not None:
            self.directions = {name: _direction(model, name, d) for name, d in directions.items()}

    @property
    def names(self) -> list[str]:
        return sorted(self.directions or ())

    def vectors(self, entries: Sequence[SteeringEntry] | None) -> tuple[SteeringVector, ...]:
        """A request's entries as vectors, or a 400 naming `steering` (not allowed, an unknown name, a layer out
        of range)."""
        if not entries:
            return ()
        if self.directions is None:
            raise ApiError(400, "steering is not allowed on this server: start it with --allow-steering NAME=FILE",
                           param="steering", code="steering_not_allowed")
        n_layer = self.model.config.n_layer
        vectors = []
        for i, e in enumerate(entries):
            if e.vector not in self.directions:
                raise ApiError(400, f"steering[{i}].vector {e.vector!r} is not a direction of this server; it has "
                               f"{', '.join(map(repr, self.names))}", param="steering", code="invalid_value")
            if e.layer >= n_layer:
                raise ApiError(400, f"steering[{i}].layer {e.layer} is out of range: this model has layers "
                               f"0..{n_layer - 1}", param="steering", code="invalid_value")
            vectors.append(SteeringVector(self.directions[e.vector], e.layer, e.scale))
        return tuple(vectors)


def _direction(model: GPT, name: str, direction: Direction) -> torch.Tensor:
    """A start-up direction read (a safetensors file, never unpickled) and checked against the model."""
    if not name:
        raise GptlabError("a steering direction needs a name")
    tensor = direction if isinstance(direction, torch.Tensor) else load_direction(direction)
    try:
        SteeringVector(tensor, 0).check(model)
    except GptlabError as e:
        raise GptlabError(f"steering direction {name!r}: {e}") from None
    return tensor.detach().float().cpu()
