"""Training: a TOML recipe, a data directory and a run directory in; metrics and checkpoints out.

    from gptlab.train import Trainer, load_train_config

    cfg = load_train_config("configs/speedrun_cpu.toml", {"max_steps": "200"})
    Trainer(cfg, "data/shakespeare_char", "runs/speedrun").run()

One module per job: `config` (the recipe, torch-free), `trainer` (the loop), `optim`, `precision`,
`distributed`, `runlog`. `Trainer` loads on first use, so checking a recipe does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gptlab.train.config import RESUMABLE_CHANGES, TrainConfig, build_train_config, load_train_config

if TYPE_CHECKING:
    from gptlab.train.trainer import Trainer

__all__ = ["RESUMABLE_CHANGES", "TrainConfig", "Trainer", "build_train_config", "load_train_config"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        return importlib.import_module("gptlab.train.trainer").Trainer
    raise AttributeError(f"module 'gptlab.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"Trainer"})
