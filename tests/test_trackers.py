"""Experiment trackers (tracker = wandb | mlflow | tensorboard): what each library wrote, read back offline with
that library's own reader, against metrics.jsonl; a resumed run continuing the same tracker run; a missing
library as a one-line error."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import make_data, one_line_error, write_recipe

from gptlab.cli import main
from gptlab.train.trackers import STATE_FILE


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("tracker_data"))


def _train(recipe: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", *extra])


def _resume_from_step_10(recipe: Path, data: Path, run: Path) -> None:
    """Continue a run of 20 steps from its step-10 checkpoint (the step-20 one removed) to step 30: steps 11-20
    are logged a second time."""
    shutil.rmtree(run / "checkpoints" / "step-0000020")
    assert _train(recipe, data, run, "--resume", "--max-steps", "30") == 0


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _expected(run: Path) -> dict[tuple[int, str], float]:
    """(step, key) -> value of every number metrics.jsonl holds."""
    out = {}
    for row in _rows(run):
        out.update({(row["step"], k): float(v) for k, v in row.items()
                    if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)})
    return out


def _tensorboard_scalars(run: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar as TensorBoard shows it (its reader applies a resumed run's purge)."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, tag, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)]


def test_tensorboard_events_are_the_metrics_rows(tmp_path: Path, data: Path) -> None:
    pytest.importorskip("tensorboard")
    recipe = write_recipe(tmp_path, max_steps=20, tracker="tensorboard", checkpoint_interval=10)
    run = tmp_path / "run"
    assert _train(recipe, data, run) == 0
    for resumed in (False, True):  # resumed from step 10: the events past it are dropped, as metrics.jsonl's rows
        if resumed:
            _resume_from_step_10(recipe, data, run)
        scalars = _tensorboard_scalars(run)
        assert Counter((s, t) for s, t, _ in scalars) == Counter((r["step"], k) for r in _rows(run) for k in r
                                                                  if k != "step")
        assert {(s, t): v for s, t, v in scalars} == pytest.approx(_expected(run), rel=1e-6)  # float32 events


def test_mlflow_run_holds_the_metrics_and_config_and_resumes(tmp_path: Path, data: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's file store: offline, no database
    recipe = write_recipe(tmp_path, max_steps=20, tracker="mlflow", tracker_project="tests",
                          checkpoint_interval=10, tensorboard=False)
    run = tmp_path / "run"
    assert _train(recipe, data, run) == 0
    _resume_from_step_10(recipe, data, run)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resumed run continued the same MLflow run
    info = runs[0]
    assert info.info.run_name == "run" and info.info.status == "FINISHED"
    assert json.loads((run / STATE_FILE).read_text())["mlflow"]["run_id"] == info.info.run_id
    assert info.data.params["train.lr"] == "0.003" and info.data.params["model.n_embd"] == "32"
    got = {}
    for key in info.data.metrics:
        got.update({(m.step, key): m.value for m in client.get_metric_history(info.info.run_id, key)})
    assert got == _expected(run)  # metrics.jsonl's rows, at the final value of each step
    # a run id the store no longer has: a one-line error naming the tracker and where its ids are kept
    state = json.loads((run / STATE_FILE).read_text())
    state["mlflow"]["run_id"] = "0" * 32
    (run / STATE_FILE).write_text(json.dumps(state))
    capsys.readouterr()
    line = one_line_error(_train(recipe, data, run, "--resume", "--max-steps", "40"), capsys.readouterr().err)
    assert "tracker mlflow could not start its run" in line and STATE_FILE in line
    assert (run / ".lock").read_text() == ""  # the run directory was let go


def _wandb_records(path: Path) -> list:
    """The records of a .wandb file: its 7-byte header, then LevelDB-log chunks (checksum, length, type) in
    32 KiB blocks carrying wandb's protobuf Records (wandb has no public reader of its own)."""
    from wandb.proto import wandb_internal_pb2

    raw, records, pending, block = path.read_bytes(), [], b"", 32768
    pos = 7
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        elif kind == 0:
            break
    return records


def _wandb_value(item) -> float:  # noqa: ANN001 - a HistoryItem: its value as JSON text, or typed
    if item.value_json:
        return float(json.loads(item.value_json))
    return float(getattr(item, item.WhichOneof("value")) if item.WhichOneof("value") else "nan")


def test_wandb_offline_run_holds_the_metrics_and_config_and_resumes(tmp_path: Path, data: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = write_recipe(tmp_path, max_steps=20, tracker="wandb", checkpoint_interval=10, tensorboard=False)
    run = tmp_path / "run"
    assert _train(recipe, data, run) == 0
    run_id = json.loads((run / STATE_FILE).read_text())["wandb"]["id"]
    first = _expected(run)
    _resume_from_step_10(recipe, data, run)
    # a resume within the same second as the first run gets the folder name with "-1" appended
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(files) == 2  # the resumed run continued the same wandb run id
    got, config = {}, {}
    for path in files:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                step = record.history.step.num
                items = {i.key or "/".join(i.nested_key): i for i in record.history.item}
                got.update({(step, k): _wandb_value(i) for k, i in items.items() if not k.startswith("_")})
            elif kind in ("config", "run"):  # the config comes with the run record, its changes on their own
                updates = record.config.update if kind == "config" else record.run.config.update
                config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in updates})
                assert kind == "config" or record.run.display_name == "run"
    # the steps past the checkpoint are in both files (the later, read last, holds metrics.jsonl's values)
    assert {k for k in first if k[0] > 10} <= set(got)
    assert got == pytest.approx(_expected(run))
    assert config["train"]["lr"] == 0.003 and config["model"]["n_embd"] == 32


def test_a_missing_tracker_library_is_a_one_line_error(tmp_path: Path, data: Path, capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    recipe = write_recipe(tmp_path, max_steps=10)
    rc = _train(recipe, data, tmp_path / "run", "--tracker", "tensorboard,wandb")
    line = one_line_error(rc, capsys.readouterr().err)
    assert "tracker wandb" in line and "gptlab[trackers]" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    rc = _train(recipe, data, tmp_path / "run", "--tracker", "neptune")
    assert "tracker = 'neptune'" in one_line_error(rc, capsys.readouterr().err)


def test_under_torchrun_only_process_0_logs_and_scores(tmp_path: Path, data: Path) -> None:
    """2 DDP processes with a tracker and benchmarks: one TensorBoard writer, one row per step, and the scores of
    one process with the same global batch (the other process waits for process 0's scoring at the next step)."""
    pytest.importorskip("tensorboard")
    task = tmp_path / "words.jsonl"
    task.write_text("".join(json.dumps({"context": f"The {w}", "choices": [" king", " queen", " lord"],
                                        "answer": i % 3}) + "\n" for i, w in enumerate(["day", "night", "sword"])))
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, log_interval=5, tracker="tensorboard",
                          eval_tasks=[str(task)], eval_tasks_interval=5)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptlab.cli",
           "train", str(recipe), "--data", str(data), "--out", str(tmp_path / "ddp"), "--quiet"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _train(recipe, data, tmp_path / "one", "--grad-accum", "2") == 0
    assert len(list((tmp_path / "ddp" / "tensorboard").glob("events.out.tfevents.*"))) == 1
    rows = [r for r in _rows(tmp_path / "ddp") if "eval/core" in r]
    one = [r for r in _rows(tmp_path / "one") if "eval/core" in r]
    assert [r["step"] for r in rows] == [r["step"] for r in one] == [5, 10]
    for a, b in zip(rows, one, strict=True):
        assert {k: v for k, v in a.items() if k.startswith("eval/")} == pytest.approx(
            {k: v for k, v in b.items() if k.startswith("eval/")}, abs=1e-6)
    assert Counter((s, t) for s, t, _ in _tensorboard_scalars(tmp_path / "ddp")) == Counter(
        (r["step"], k) for r in _rows(tmp_path / "ddp") for k in r if k != "step")
