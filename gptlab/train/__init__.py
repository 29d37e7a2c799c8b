"""Training: a TOML recipe, a data directory and a run directory in; metrics and checkpoints out.

    from gptlab.train import Trainer, load_train_config

    cfg = load_train_config("configs/speedrun_cpu.toml", {"max_steps": "200"})
    Trainer(cfg, "data/shakespeare_char", "runs/speedrun").run()

One module per job: `config` (the recipe's fields, torch-free), `recipe` (reading it), `trainer` (the loop),
`optim`, `precision`, `distributed`, `runlog`, `rundir`, `stopping`. `Trainer` loads on first use, so checking
a recipe does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptlab.lazy import lazy_exports
from gptlab.train.config import RESUMABLE_CHANGES, TrainConfig
from gptlab.train.recipe import build_train_config, load_train_config

if TYPE_CHECKING:
    from gptlab.train.trainer import Trainer

__all__ = ["RESUMABLE_CHANGES", "TrainConfig", "Trainer", "build_train_config", "load_train_config"]

__getattr__, __dir__ = lazy_exports(__name__, {"Trainer": "gptlab.train.trainer"})
