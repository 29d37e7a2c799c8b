"""What a training run records, so that runs can be compared and plotted afterwards.

- metrics.jsonl in the run directory: one JSON object per logged step, flushed as it is written, so a killed
  run keeps every row up to its end (a resumed run first drops the rows past its checkpoint, see the trainer);
- the same rows to the run's experiment trackers (`gptlab.train.trackers`: TensorBoard, wandb, MLflow);
- MFU (model FLOPs utilization) against this machine's measured matmul peak (`gptlab.hardware.peak_flops`),
  which is honest on a laptop CPU where a datasheet number would not be; on a GPU the datasheet knows (an H100's
  989 TFLOP/s dense bf16) also `mfu_datasheet` against that: what nanoGPT, nanochat and Lightning report.
  Both count the model's matmul FLOPs as `gptlab.flops` does (causal attention at half the T x T products; under
  LoRA no weight gradient of the frozen weights, and the adapters' products).

Only one process of a distributed run writes: the others get `enabled=False`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gptlab.train.trackers import Tracker, close_trackers

METRICS_FILE = "metrics.jsonl"


class RunLog:
    """metrics.jsonl rows, the trackers' copies and progress messages of one run."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        quiet: bool,
        trackers: Sequence[Tracker] = (),
        flops_per_token: float,
        device: str,
        world_size: int,
        dtype: str,
    ) -> None:
        """`flops_per_token` and `world_size` turn tokens/s into MFU; `dtype` is the training dtype's name."""
        self.enabled, self.quiet = enabled, quiet
        self.file = open(run_dir / METRICS_FILE, "a") if enabled else None  # noqa: SIM115 - closed in close()
        self.trackers = list(trackers) if enabled else []
        self.flops_per_token = flops_per_token
        self.device, self.world_size = device, world_size
        # low-precision matmuls (bf16 or fp16) peak alike; measure the one every device has
        self.peak_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        self._peak: float | None = None

    def utilization(self, tokens_per_sec: float) -> dict[str, float]:
        """{"mfu"} against the measured peak, and {"mfu_datasheet"} where the device's datasheet peak is known."""
        out = {"mfu": self.mfu(tokens_per_sec)}
        from gptlab.hardware import datasheet_flops

        peak = datasheet_flops(self.device) if self.peak_dtype == torch.bfloat16 else None
        if peak:
            out["mfu_datasheet"] = self.flops_per_token * tokens_per_sec / (peak * self.world_size)
        return out

    def mfu(self, tokens_per_sec: float) -> float:
        """Share of the machine's matmul peak (over all processes) that `tokens_per_sec` amounts to."""
        if self._peak is None:  # measured on first use (or read from the cache), not at start-up
            from gptlab.hardware import peak_flops

            self._peak = peak_flops(self.device, self.peak_dtype) * self.world_size
        return self.flops_per_token * tokens_per_sec / self._peak

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for tracker in self.trackers:
            tracker.log(row)

    def say(self, text: str) -> None:
        """A message on stderr, from the writing process only and not under --quiet."""
        if self.enabled and not self.quiet:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        close_trackers(self.trackers)


def progress_bar(total: int, initial: int, show: bool) -> Any:
    """A tqdm bar of the run's steps on a terminal (None when not `show`n or stderr is not a terminal). Its loss
    is updated at log rows only: reading the loss every step would make the host wait for the device."""
    if not show or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
