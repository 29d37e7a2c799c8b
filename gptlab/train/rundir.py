"""The run directory's safety: one run at a time, metrics that survive a kill, and resuming from a checkpoint that
is really there.

- `RunLock`: `gptlab train` holds an exclusive `flock` on RUN_DIR/.lock for its whole life, so a second run
  pointed at the same directory refuses at once instead of interleaving checkpoints with the first. The kernel
  drops the lock when its process dies (even under SIGKILL), so a lock can never go stale; the pid written in
  the file only says who holds it, and a pid left by a killed run is taken over with a notice.
- `trim_metrics`: a resumed run drops metrics.jsonl's rows past its checkpoint (they will be written again); a
  last line torn by a kill mid-write is dropped with a notice, while damage elsewhere is an error naming the line.
- `checkpoint_to_resume`: the latest step checkpoint, with its files checked before anything is loaded; a
  damaged one is named, with the intact earlier checkpoint and how to resume from it.
- `check_checkpoint_matches` / `check_state_matches`: the checkpoint is this run's (vocabulary, model, LoRA base,
  recipe, data sources), each difference named.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any

from gptlab import checkpoint as ckpt
from gptlab.data.dataset import format_sources
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_json, atomic_write_text, parse_json, safetensors_problem, write_error
from gptlab.train.config import RESUMABLE_CHANGES, TrainConfig, resume_differences
from gptlab.train.runlog import METRICS_FILE

LOCK_FILE = ".lock"
# what a resumable step checkpoint's state.json must hold (the trainer writes more)
STATE_KEYS = {"step": int, "elapsed_sec": (int, float), "best_val_loss": (int, float, type(None)), "rng": dict,
              "config_hash": str, "config": dict, "optimizers": list}


class RunLock:
    """An exclusive lock on a run directory, held until `release()` (or the process's end)."""

    def __init__(self, run_dir: Path, quiet: bool = False) -> None:
        self.path = run_dir / LOCK_FILE
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise write_error(run_dir, e) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)
            self.fd = -1
            who = f" (pid {holder})" if holder else ""
            raise GptlabError(f"{run_dir} is in use by another `gptlab train`{who}: wait for it to end, or choose "
                              "another --out") from None
        stale = self._holder()
        if stale and stale != str(os.getpid()) and not quiet:
            print(f"note: taking over {self.path} from pid {stale}, which ended without releasing it",
                  file=sys.stderr)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def _holder(self) -> str:
        try:
            return os.pread(self.fd, 64, 0).decode(errors="replace").strip()
        except OSError:
            return ""

    def __del__(self) -> None:  # a Trainer dropped without run(): its lock goes with it
        self.release()

    def release(self) -> None:
        if getattr(self, "fd", -1) < 0:
            return
        os.ftruncate(self.fd, 0)  # an empty file: released cleanly (a pid left in it means a killed run)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


def prepare_run_dir(run_dir: Path, resolved: dict, step: int, quiet: bool = False) -> None:
    """config.resolved.json (`resolved`: the recipe as it runs), and for a run resumed at `step` metrics.jsonl
    without the rows past its checkpoint (they will be written again)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / ckpt.RESOLVED_CONFIG, resolved)
    trim_metrics(run_dir / METRICS_FILE, step, quiet)


def trim_metrics(path: Path, last_step: int, quiet: bool = False) -> None:
    """Keep metrics.jsonl's rows up to `last_step`; drop a torn last line (a kill mid-write) with a notice."""
    if not path.exists():
        return
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError as e:
        raise GptlabError(f"cannot read {path}: {e.strerror or e} (move it aside to continue)") from None
    rows = []
    for i, line in enumerate(lines):
        try:
            row = parse_json(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError, OverflowError):
            if i == len(lines) - 1:
                if not quiet:
                    print(f"note: dropped the torn last line of {path} (a run stopped while writing it)",
                          file=sys.stderr)
                break
            raise GptlabError(f"{path} line {i + 1} is not a metrics row ({line[:60]!r}): remove that line or "
                              "the file to continue") from None
        if step <= last_step:
            rows.append(line)
    atomic_write_text(path, "".join(r + "\n" for r in rows))


def _damage(directory: Path) -> str | None:
    """What is wrong with a step checkpoint's files, read cheaply (headers and JSON only), or None."""
    weights = directory / ckpt.LORA_FILE if (directory / ckpt.LORA_FILE).is_file() else directory / ckpt.MODEL_FILE
    for path in (weights, directory / ckpt.OPTIMIZER_FILE):
        problem = safetensors_problem(path)
        if problem:
            return problem
    try:
        state = ckpt.read_training_state(directory, STATE_KEYS)
    except GptlabError as e:
        return str(e)
    if state["step"] != int(directory.name.split("-", 1)[1]):
        return f"{directory / ckpt.STATE_FILE} says step {state['step']}, its directory is {directory.name}"
    return None


def checkpoint_to_resume(run_dir: Path) -> Path:
    """The latest step checkpoint of `run_dir`, checked; a GptlabError naming what is damaged and the newest
    intact earlier checkpoint (and how to resume from it) if it is not sound."""
    steps = ckpt.list_step_checkpoints(run_dir)
    if not steps:
        raise GptlabError(f"--resume: {run_dir} has no checkpoint to continue from (expected "
                          f"{ckpt.CHECKPOINTS_DIR}/step-*/); drop --resume to start a fresh run")
    latest = steps[-1]
    problem = _damage(latest)
    if problem is None:
        return latest
    intact = next((s for s in reversed(steps[:-1]) if _damage(s) is None), None)
    aside = latest.with_name(f"damaged-{latest.name}")
    hint = (f"{intact} is intact: move the damaged one aside (mv {latest} {aside}) and run again with --resume"
            if intact else "no earlier checkpoint is intact: start again without --resume in a new --out")
    raise GptlabError(f"cannot resume from {latest}: {problem}; {hint}")


def check_checkpoint_matches(directory: Path, model: Any, cfg: TrainConfig, data_dir: Path) -> None:
    """Before a step checkpoint loads into this run's model: the same vocabulary, the same model config, and
    under LoRA the same base weights; else a GptlabError saying which differs."""
    saved = ckpt.read_config(directory / ckpt.CONFIG_FILE)
    if saved.vocab_size != model.config.vocab_size:
        raise GptlabError(f"cannot resume {directory}: it was trained on a vocabulary of {saved.vocab_size} "
                          f"tokens, --data {data_dir} has {model.config.vocab_size} (another "
                          "tokenizer?): use the data it was trained on, or start a new --out")
    ours = model.config.to_dict()
    differ = [k for k, v in saved.to_dict().items() if ours.get(k) != v]
    if differ:
        k, was = differ[0], saved.to_dict()[differ[0]]
        if _model_keys_changed(directory, cfg):  # the user's recipe or flags, not the file
            raise GptlabError(f"cannot resume {directory}: this run's recipe and flags give {k}={ours.get(k)!r}, "
                              f"the run was trained with {k}={was!r}, and a run's model cannot change on resume: "
                              f"drop the change (--{k.replace('_', '-')} or the recipe's {k}), or start a new --out")
        raise GptlabError(f"cannot resume {directory}: its {ckpt.CONFIG_FILE} says {k}={was!r}, "
                          f"this run's model has {ours.get(k)!r} (a damaged or edited file?)")
    if (directory / ckpt.LORA_CONFIG).is_file():
        _, base = ckpt.read_lora_config(directory)
        if base["sha256"] != model.lora_base["sha256"]:
            raise GptlabError(f"cannot resume {directory}: its adapters were trained on a base with other weights "
                              f"({base['path']}) than init_from {cfg.init_from} has now")


def _model_keys_changed(directory: Path, cfg: TrainConfig) -> bool:
    """Whether `cfg` asks for another model than the recipe the checkpoint's run was trained with (its preset or
    model keys)."""
    trained = ckpt.read_training_state(directory, {"config": dict})["config"]
    now = json.loads(json.dumps(cfg.to_dict()))  # as state.json reads back
    return any(trained.get(key) != now[key] for key in ("model", "model_overrides"))


def check_state_matches(directory: Path, state: dict[str, Any], cfg: TrainConfig,
                        sources: list[tuple[Path, float]]) -> None:
    """After state.json is read: the recipe differs only in keys a resume may change, and the data sources are
    those the run was trained on (one directory may move; a mixture's batches would differ)."""
    if state["config_hash"] != cfg.hash(RESUMABLE_CHANGES):
        saved, now = state["config"], cfg.to_dict()
        diff = resume_differences(saved, cfg)  # none: only keys this checkpoint predates are new
        shown = ", ".join(f"{k} ({saved.get(k)!r} -> {now[k]!r})" for k in diff[:4])
        if diff:
            raise GptlabError(f"cannot resume {directory}: the config differs in {shown}; only "
                              f"{', '.join(sorted(RESUMABLE_CHANGES))} may change")
    saved_sources, ours = state.get("data_sources", []), [[str(d), w] for d, w in sources]
    if max(len(ours), len(saved_sources)) > 1 and saved_sources != ours:
        raise GptlabError(f"cannot resume {directory}: it was trained on --data {format_sources(saved_sources)}, "
                          f"not {format_sources(ours)}: its batches would differ")
