"""Experiment trackers: metrics.jsonl's rows sent to Weights & Biases, MLflow or TensorBoard as well.

Each tracker is its own library, installed with `pip install gptlab[trackers]`; the recipe's `tracker` names
the ones a run uses, and one that is not installed is a one-line error before the first step. TensorBoard
is also on by default (`tensorboard = true`) where its package imports, as before: silently skipped there
when missing, since nobody asked for it by name.

Every tracker gets the same rows as metrics.jsonl (numbers only, at the row's step), the resolved config
(config.resolved.json) and the run directory's name as the run's name. A resumed run continues the same
tracker run where the library allows: the wandb run id and the MLflow run id (with its tracking URI) are kept
in RUN_DIR/trackers.json, and TensorBoard drops the events past the checkpoint (`purge_step`), as
metrics.jsonl drops its rows. The steps between the checkpoint and the stop are sent to wandb again; an
online wandb run ignores steps below its last one, so it keeps their first values.

Where they write: wandb under RUN_DIR/wandb (WANDB_MODE=offline for no network; WANDB_* settings apply);
MLflow where MLFLOW_TRACKING_URI points (its own default otherwise); TensorBoard RUN_DIR/tensorboard.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_json, read_json_object
from gptlab.train.config import TrainConfig

STATE_FILE = "trackers.json"  # what a resumed run needs to continue its tracker runs


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers, without its step: what a tracker plots."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys -> text (MLflow's parameters are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


class Tracker:
    """One tracker's run: `log` a metrics row, `close` at the end; `state` is what a resumed run reuses."""

    state: dict[str, Any] = {}

    def log(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path, config: dict[str, Any], step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run's events from `step` on are discarded, as metrics.jsonl's rows past the checkpoint are
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1 if step else None)
        if not step:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```")

    def log(self, row: dict[str, Any]) -> None:
        for key, value in _numbers(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, saved: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=run_dir.resolve().name, dir=str(run_dir), config=config,
                              id=saved.get("id"), resume="allow" if saved.get("id") else None)
        self.state = {"id": self.run.id}

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_numbers(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, saved: dict[str, Any]) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.mlflow = mlflow
        uri = saved.get("tracking_uri") or mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri=uri)
        run_id = saved.get("run_id")
        if run_id is None:
            found = self.client.get_experiment_by_name(project)
            experiment = found.experiment_id if found else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment, run_name=run_dir.resolve().name).info.run_id
            params = [mlflow.entities.Param(k, v[:6000]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # a call takes at most 100 parameters (and 1000 metrics)
                self.client.log_batch(run_id, params=params[i : i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.state = {"run_id": run_id, "tracking_uri": uri}

    def log(self, row: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.mlflow.entities.Metric(k, v, now, row["step"]) for k, v in _numbers(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def check_trackers(cfg: TrainConfig) -> None:
    """A one-line error for a tracker the recipe names whose library is not installed (before the first step)."""
    for name in cfg.tracker:  # each tracker's package is named as the tracker
        if importlib.util.find_spec(name) is None:
            raise GptlabError(f"tracker {name}: the {name} package is not installed (pip install "
                              f"'gptlab[trackers]')")


def open_trackers(cfg: TrainConfig, run_dir: Path, config: dict[str, Any], step: int,
                  quiet: bool = False) -> list[Tracker]:
    """The trackers a run logs to: the recipe's `tracker`s, plus TensorBoard when `tensorboard` is on and its
    package imports. `config` is what they record; `step` is where a resumed run starts (0: a fresh run)."""
    check_trackers(cfg)
    names, project = list(dict.fromkeys(cfg.tracker)), cfg.tracker_project
    tensorboard = cfg.tensorboard
    if tensorboard and "tensorboard" not in names:
        if importlib.util.find_spec("tensorboard") is not None:
            names.append("tensorboard")
        elif not quiet:  # said once, at the start: the recipe asked for events this run cannot write
            print("note: tensorboard = true but the tensorboard package is not installed: no TensorBoard "
                  "events (pip install tensorboard, or set tensorboard = false)", file=sys.stderr)
    path = run_dir / STATE_FILE
    saved = read_json_object(path) if step and path.is_file() else {}
    trackers: dict[str, Tracker] = {}
    try:
        for name in names:
            trackers[name] = _start(name, run_dir, config, project, step, saved.get(name, {}))
    except BaseException:
        close_trackers(trackers.values())
        raise
    states = {name: t.state for name, t in trackers.items() if t.state}
    if states:
        atomic_write_json(path, {**saved, **states})
    return list(trackers.values())


def _start(name: str, run_dir: Path, config: dict[str, Any], project: str, step: int,
           saved: dict[str, Any]) -> Tracker:
    """One tracker's run; what its library raises (a server it cannot reach, a resumed run it no longer has) is
    a one-line error naming the tracker."""
    try:
        if name == "tensorboard":
            return TensorBoardTracker(run_dir, config, step)
        if name == "wandb":
            return WandbTracker(run_dir, config, project, saved)
        return MlflowTracker(run_dir, config, project, saved)
    except Exception as e:  # noqa: BLE001 - each library has its own errors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = f" (its ids are in {run_dir / STATE_FILE})" if saved else ""
        raise GptlabError(f"tracker {name} could not start its run: {first}{hint}") from e


def close_trackers(trackers: Iterable[Tracker]) -> None:
    """Close every tracker, even when one fails to (the first failure is raised after the rest are closed)."""
    failure: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as e:  # noqa: BLE001 - the others must still close
            failure = failure or e
    if failure is not None:
        raise failure
