"""What the checkpoint modules agree on: the files a checkpoint and a run's `checkpoints/` directory hold (see
the package docstring), which directories count as checkpoints, and the plain model a checkpoint describes.

A step checkpoint is `checkpoints/step-NNNNNNN` holding weights; anything else there (a temporary
`.step-*.tmp-*` directory of a write in progress or killed, a copy moved aside such as `damaged-step-N`) is
skipped by `list_step_checkpoints`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from gptlab.fileio import read_json_object

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CHECKPOINTS_DIR = "checkpoints"
BEST_NAME = "best"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
TOKENIZER_FILES = ("tokenizer_meta.json", "tokenizer.json")
LORA_FILE = "lora.safetensors"
LORA_CONFIG = "lora.json"
LORA_FORMAT = "gptlab-lora"
# safetensors' dtype names (a file's header) and the torch dtypes they hold
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
STEP_NAME = re.compile(r"step-\d+")  # a step checkpoint (a copy moved aside, e.g. damaged-step-N, is not)
RESOLVED_CONFIG = "config.resolved.json"  # a run's recipe as it ran: its settings, model config and data directory


def has_weights(directory: Path) -> bool:
    """Whether a directory holds gptlab weights: a whole model, or a LoRA run's adapters."""
    return (directory / MODEL_FILE).is_file() or (directory / LORA_FILE).is_file()


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def list_step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints, oldest first (complete ones only: temporary directories are skipped)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if STEP_NAME.fullmatch(p.name) and has_weights(p)]
    return sorted(steps, key=lambda p: int(p.name.split("-", 1)[1]))


def recorded_data_dir(path: str | Path) -> Path | None:
    """The data directory a run trained on (`gptlab train --data`, as its config.resolved.json records it), for a
    run directory or a checkpoint inside one (RUN/checkpoints/NAME); None where no such file records one. A
    damaged file is a GptlabError naming it."""
    data = recorded_setting(path, "data")
    return Path(data) if isinstance(data, str) and data else None


def recorded_setting(path: str | Path, key: str) -> Any:
    """The value of `key` in the recipe a run trained with (its config.resolved.json), for a run directory or a
    checkpoint inside one; None where no such file records one (a model from elsewhere)."""
    path = Path(path)
    run = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else path
    if not (run / RESOLVED_CONFIG).exists():
        return None
    return read_json_object(run / RESOLVED_CONFIG).get(key)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain GPT under torch.compile's OptimizedModule and DDP/FSDP wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model
