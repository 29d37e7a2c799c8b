"""Stopping a run on SIGINT / SIGTERM at a step boundary, the same step on every process.

The handler only records the signal; the loop checkpoints after the current step and exits 0 with the command
that resumes. Under torchrun each process's "seen a signal" flag is all-reduced inside the step (`sum_and_any`)
and read one step late, so the host never waits for that collective, and every process takes the same decision.
A second Ctrl-C stops at once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import torch


class StopRequest:
    """Whether the run was asked to stop, as this process saw it and as all processes agreed."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.signal: int | None = None  # the signal seen here (or SIGTERM when another process saw one)
        self._flag: torch.Tensor | None = None  # the step before's all-reduced flag, read at the next step
        self._agreed = False

    @property
    def seen(self) -> bool:
        return self.signal is not None

    def agree(self, any_stop: torch.Tensor | bool) -> None:
        """Take this step's all-reduced flag (a tensor under torchrun) and read the previous step's."""
        if not isinstance(any_stop, torch.Tensor):
            return
        previous, self._flag = self._flag, any_stop
        self._agreed = self._agreed or (previous is not None and bool(previous))
        if self._agreed and self.signal is None:
            self.signal = signal.SIGTERM

    @property
    def due(self) -> bool:
        """Stop after this step: every process alike under torchrun."""
        return self._agreed if self.world > 1 else self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "?"

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:  # a second Ctrl-C: stop right now
            raise KeyboardInterrupt
        self.signal = signum

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """SIGINT and SIGTERM recorded here for the block's duration; the previous handlers restored after."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
