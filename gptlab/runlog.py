"""What a training run records: metrics.jsonl (one JSON object per row), TensorBoard events when the
tensorboard package is installed, and MFU against this machine's measured matmul peak (gptlab.hardware)."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"


class RunLog:
    """metrics.jsonl (a JSON object per row), TensorBoard when installed, MFU against this machine's peak."""

    def __init__(self, trainer: Any, enabled: bool) -> None:  # a gptlab.train.Trainer
        self.enabled, self.quiet = enabled, trainer.quiet
        self.file = open(trainer.run_dir / METRICS_FILE, "a") if enabled else None  # noqa: SIM115
        self.tb = None
        if enabled and trainer.cfg.tensorboard:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is not None:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(trainer.run_dir / "tensorboard"))
        from gptlab.hardware import flops_per_token

        cfg = trainer.model.config
        self.flops_per_token = flops_per_token(
            trainer.model.num_parameters(), cfg.n_layer, cfg.n_embd, cfg.block_size
        )
        self.device, self.world = trainer.device, trainer.world
        self.dtype = torch.float32 if trainer.cfg.dtype == "float32" else torch.bfloat16
        self._peak: float | None = None

    def mfu(self, tokens_per_sec: float) -> float:
        if self._peak is None:
            from gptlab.hardware import peak_flops

            self._peak = peak_flops(self.device, self.dtype) * self.world
        return self.flops_per_token * tokens_per_sec / self._peak

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step":
                    self.tb.add_scalar(key, value, row["step"])

    def say(self, text: str) -> None:
        if self.enabled and not self.quiet:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
