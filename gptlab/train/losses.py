"""The training losses, kept on the device and read back only when the trainer needs a number.

Reading a GPU tensor's value (`float(loss)`) makes the host wait until the device has finished everything queued
before it, so a loop that reads every step's loss keeps the device idle while the host prepares the next step.
The trainer records each step's loss here and reads them all at once at a log row, an evaluation, a checkpoint
or the end: one host read per read-out instead of one per step.

A non-finite loss must still never change the weights. That is decided on the device, as GradScaler decides for
fp16: `add` returns a flag that is true from the first non-finite loss on, and the optimizer step is skipped
where it is true (`gptlab.train.optim.step_optimizers`). It stays true, so the steps between the bad one and the
read-out change nothing either, and `read` then names the first bad step: the run stops as it stopped when it
read every loss, only at the read-out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.errors import GptlabError


@dataclass(frozen=True)
class NonFinite:
    """The first step (0-based) whose loss was not finite, and that loss."""

    step: int
    loss: float

    def error(self, checkpoints: list[Path]) -> GptlabError:
        """The run's stop, naming the step (1-based) and the run's latest checkpoint (`checkpoints`, oldest first)."""
        where = f"last good checkpoint: {checkpoints[-1]}" if checkpoints else "no checkpoint was written yet"
        return GptlabError(f"loss is {self.loss} at step {self.step + 1}; stopped without updating the weights "
                           f"({where}). Try a lower lr (or init_std, for a fresh model), grad_clip, or float32")


class DeviceLosses:
    """The per-step losses since the last `read`, each a 0-dim tensor summed over `world` processes."""

    def __init__(self, world: int = 1) -> None:
        self.world = world
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._bad: torch.Tensor | None = None  # sticky: true from the first non-finite loss on
        self.last = math.nan  # the latest loss read

    def add(self, step: int, loss_sum: torch.Tensor) -> torch.Tensor:
        """Record `step`'s loss; returns the 0-dim bool tensor under which that step must not change anything
        (true when this or an earlier unread loss was not finite)."""
        bad = ~torch.isfinite(loss_sum)
        self._bad = bad if self._bad is None else self._bad | bad
        self._pending.append((step, loss_sum.detach()))
        return self._bad

    def read(self) -> tuple[float, NonFinite | None]:
        """The latest step's loss (the mean over processes) and the first non-finite one since the last read, if
        any, in one host read; nothing is read when no step ran since."""
        if not self._pending:
            return self.last, None
        steps = [s for s, _ in self._pending]
        # one transfer of every pending loss; the sum over processes is divided on the host, in double, as the
        # loss always was
        values = [v / self.world for v in torch.stack([t for _, t in self._pending]).tolist()]
        self._pending.clear()
        self.last = values[-1]
        bad = next((NonFinite(s, v) for s, v in zip(steps, values, strict=True) if not math.isfinite(v)), None)
        if bad is None:
            self._bad = None  # every loss so far was finite: a fresh flag, not a growing chain of ors
        return self.last, bad
