"""Benchmarks scored during training: the recipe's `eval_tasks`, every `eval_tasks_interval` steps and at the
end, into metrics.jsonl (as "eval/<task>/<metric>") and so into the trackers and `gptlab plot`.

A task is a multiple-choice .jsonl file (`gptlab.evaluation.tasks`, offline; with them comes "eval/core", the
mean of their centered accuracies), or an lm-eval task: a name from lm-eval's index (its data must be
downloadable or cached) or a task YAML file. lm-eval sits above training in the pipeline, so its tasks arrive
as a scorer (`gptlab.evaluation.harness.LmEvalTasks`) handed to the trainer: `gptlab train` does that.

Scoring leaves training as it found it: the model goes back to its mode even when a task raises, and the random
streams (torch's on the model's device, Python's and numpy's) are set aside and restored, so a run's weights
are the same with or without benchmarks. Only the master process scores (under DDP the others wait at the next
step's all-reduce, for at most `distributed_timeout`); FSDP's sharded model cannot be scored by one process.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.errors import GptlabError
from gptlab.evaluation.tasks import load_choice_task, score_choice_tasks
from gptlab.tokenizer import load_tokenizer
from gptlab.train.config import TrainConfig

# (model, tokenizer, run name) -> {"<task>/<metric>": value}: lm-eval's tasks, scored in memory
LmEvalScorer = Callable[[torch.nn.Module, Any, str], dict[str, float]]


def lm_eval_task_names(cfg: TrainConfig) -> list[str]:
    """The recipe's eval_tasks that lm-eval scores: every one but the .jsonl files."""
    return [t for t in cfg.eval_tasks if not t.endswith(".jsonl")]


class Benchmarks:
    """A run's eval_tasks, loaded and checked once (before the first step)."""

    def __init__(self, cfg: TrainConfig, data_dir: Path, lm_eval: LmEvalScorer | None = None,
                 sharded: bool = False) -> None:
        if sharded:
            raise GptlabError("eval_tasks are scored by one process, which under distributed = \"fsdp\" holds only "
                              "its shards: use ddp, or score checkpoints afterwards with `gptlab eval --tasks`")
        self.tasks = [load_choice_task(t) for t in cfg.eval_tasks if t.endswith(".jsonl")]
        names = [t.name for t in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise GptlabError(f"eval_tasks: two task files are both named {twice[0]}.jsonl; rename one")
        others = lm_eval_task_names(cfg)
        if others and lm_eval is None:
            raise GptlabError(f"eval_tasks {', '.join(others)}: lm-eval tasks need a scorer for them "
                              "(gptlab.evaluation.harness.LmEvalTasks, which `gptlab train` passes)")
        self.lm_eval = lm_eval if others else None
        self.tokenizer = load_tokenizer(data_dir)
        self.interval, self.limit = cfg.eval_tasks_interval, cfg.eval_tasks_limit

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def score(self, model: torch.nn.Module, run_name: str,
              autocast: contextlib.AbstractContextManager | None = None) -> dict[str, float]:
        """Every task's metrics as {"eval/<task>/<metric>": value}, the model in eval mode meanwhile."""
        was_training = model.training
        device = next(model.parameters()).device
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    autocast or contextlib.nullcontext():
                model.eval()
                scores = score_choice_tasks(model, self.tokenizer, self.tasks, limit=self.limit)
                if self.lm_eval is not None:
                    scores.update(self.lm_eval(model, self.tokenizer, run_name))
        finally:
            model.train(was_training)
            random.setstate(python_state)
            np.random.set_state(numpy_state)
        return {f"eval/{k}": v for k, v in scores.items()}
