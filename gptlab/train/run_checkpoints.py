"""A run's checkpoints, for the trainer: what a step checkpoint's state.json holds, writing one (keeping the newest
`keep_last`), the best weights so far, and loading one to resume after checking it is this run's.

A step checkpoint is the weights, the optimizers' state and state.json: where the run is (step, clock, best val
loss, when warm-up ended, tokens seen), every process's random streams, and what it must match to be resumed (the
recipe's hash, the data sources; the loader's position in each is the step).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab import checkpoint as ckpt
from gptlab.train.config import RESUMABLE_CHANGES
from gptlab.train.rng import restore_rng_state, rng_state
from gptlab.train.rundir import check_checkpoint_matches, check_state_matches

if TYPE_CHECKING:
    from gptlab.train.trainer import Trainer


def run_state(t: Trainer, rng: dict[str, Any]) -> dict[str, Any]:
    """state.json of a step checkpoint of `t`: where the run is, and what it must match to be resumed."""
    return {
        "step": t.step,
        "elapsed_sec": t.elapsed,
        "best_val_loss": t.best_val if math.isfinite(t.best_val) else None,
        "warmup_elapsed_sec": t.warmup_elapsed,
        "ended_at_step": t.ended_at,  # the step the run last ended at, its final evaluation done (-1: none yet)
        "tokens_seen": t.feed.seen_tokens,  # the input tokens the steps fed (`StepBatch.tokens`), summed
        "rng": rng,
        "config_hash": t.cfg.hash(RESUMABLE_CHANGES),
        "config": t.cfg.to_dict(),
        "data_dir": str(t.data_dir),
        "data_sources": [[str(d), w] for d, w in t.sources],  # the loader's position in each is the step
    }


def tokens_seen(state: dict[str, Any], t: Trainer) -> int:
    """The tokens a checkpoint's steps fed, as it stored them (a sum over steps that resuming cannot redo cheaply);
    a checkpoint without the number: steps x their whole windows (a pair's two), which cut rows do not fill."""
    stored = state.get("tokens_seen")
    if isinstance(stored, int) and not isinstance(stored, bool) and stored >= 0:
        return stored
    return t.step * t.cfg.batch_size * t.seq_len * (2 if t.train_data.pairs else 1)


def save_step_checkpoint(t: Trainer, gather: bool) -> Path | None:
    """`Trainer.save_checkpoint`: every process calls it (each one's dropout stream is gathered, unless `gather`
    is False, after an error); the path on the writing process."""
    rng = rng_state(t.procs, gather)
    if not t.procs.is_master and not t.fsdp:  # under FSDP every process writes its own rows
        return None
    path = t.run_dir / ckpt.CHECKPOINTS_DIR / ckpt.step_dir_name(t.step)
    written = ckpt.save_checkpoint(path, t.model, run_state(t, rng), t.optimizers, tokenizer_dir=t.data_dir,
                                   writer=t.procs.is_master)
    if written is not None:
        ckpt.prune_checkpoints(t.run_dir, t.cfg.keep_last)
    return written


def save_best_weights(t: Trainer) -> None:
    """checkpoints/best/: the weights of the best validation loss so far (no optimizer state)."""
    if not t.procs.is_master and not t.fsdp:
        return
    ckpt.save_checkpoint(t.run_dir / ckpt.CHECKPOINTS_DIR / ckpt.BEST_NAME, t.model,
                         {"step": t.step, "val_loss": t.best_val}, tokenizer_dir=t.data_dir,
                         writer=t.procs.is_master)


def load_run_checkpoint(t: Trainer, directory: Path) -> None:
    """Resume `t` from the step checkpoint `directory`, checked first to be this run's (model, recipe, data)."""
    check_checkpoint_matches(directory, t.model, t.cfg, t.data_dir)
    # the recipe before the tensors: a changed lora_rank, lora_targets or optimizer is named as such, not as a
    # tensor of the wrong shape
    check_state_matches(directory, ckpt.read_training_state(directory, {"config_hash": str, "config": dict}), t.cfg,
                        t.sources)
    state = ckpt.load_training_checkpoint(directory, t.model, t.optimizers)
    t.step, t.elapsed = state["step"], state["elapsed_sec"]
    t.best_val = state["best_val_loss"] if state["best_val_loss"] is not None else math.inf
    t.warmup_elapsed = state.get("warmup_elapsed_sec", t.warmup_elapsed)
    t.ended_at = state.get("ended_at_step", -1)
    t.feed.seen_tokens = tokens_seen(state, t)
    if t.warmup_elapsed is None and t.step >= t.cfg.warmup_steps:  # a checkpoint from before the key
        t.warmup_elapsed = t.elapsed * t.cfg.warmup_steps / t.step  # steps of about equal time
    restore_rng_state(state["rng"], t.procs, t.cfg.seed, t.step)
    t.precision.sync_weights()
