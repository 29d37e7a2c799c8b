"""The tokens a run has trained on: state.json's tokens_seen and metrics.jsonl's cumulative tokens_seen are the sum of
the tokens its steps fed (a preference pair's two rows cut after the micro-step's longest reply, not whole windows),
kept across a resume from what the checkpoint stored; `gptlab plot --x tokens` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import PAIRS, make_data, pairs_data

from gptlab.checkpoint import list_step_checkpoints
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.inspection.curves import read_curves
from gptlab.train.batches import TokenSplit, step_batch

RECIPE = ('model = "tiny"\nobjective = "dpo"\nbatch_size = 4\ngrad_accum = 2\nwarmup_steps = 1\nlog_interval = 1\n'
          "lr = 3e-3\nblock_size = 96\ntensorboard = false\nthreads = 1\ndropout = 0.0\n")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _state(run: Path) -> dict:
    return json.loads((list_step_checkpoints(run)[-1] / "state.json").read_text())


def _fed(data: Path, steps: range, seed: int = 1337) -> list[int]:
    """The input tokens each step feeds on one process with grad_accum 2 (`StepBatch.tokens`)."""
    split = TokenSplit.load(data, "train")
    return [step_batch(split, seed, s, 4, split.window_tokens - 1).tokens(1, 2) for s in steps]


def test_a_dpo_runs_tokens_are_the_rows_it_fed_across_a_resume_and_plot_reads_them(tmp_path: Path) -> None:
    data = pairs_data(tmp_path, PAIRS * 4)
    recipe = tmp_path / "dpo.toml"
    recipe.write_text(RECIPE)
    fed = _fed(data, range(6))
    window = TokenSplit.load(data, "train").window_tokens - 1
    assert sum(fed) < 6 * 8 * window  # the rows are cut: whole windows would overcount
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet", "--max-steps", "6"]) == 0
    assert _state(run)["tokens_seen"] == sum(fed)
    rows = _rows(run)
    logged = [r for r in rows if "train_loss" in r]
    assert [r["tokens_seen"] for r in logged] == [sum(fed[: r["step"]]) for r in logged]
    assert rows[-1]["tokens_seen"] == sum(fed)  # the final evaluation's row too

    # killed at step 3's checkpoint, resumed: the count continues from what the checkpoint stored
    part = tmp_path / "part"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(part), "--quiet", "--max-steps", "3"]) == 0
    state_file = list_step_checkpoints(part)[-1] / "state.json"
    state = json.loads(state_file.read_text())
    assert state["tokens_seen"] == sum(fed[:3])
    state["tokens_seen"] += 1_000  # stored, not recomputed: a resume adds to the stored value
    state_file.write_text(json.dumps(state))
    assert main(["train", str(recipe), "--data", str(data), "--out", str(part), "--quiet", "--max-steps", "6",
                 "--resume"]) == 0
    assert _state(part)["tokens_seen"] == sum(fed) + 1_000
    assert [r["tokens_seen"] for r in _rows(part) if r["step"] > 3] == \
        [sum(fed[: r["step"]]) + 1_000 for r in _rows(part) if r["step"] > 3]

    # plot's x is the rows' own count
    curve = read_curves(run, x="tokens")
    assert curve.train_loss.x == [float(r["tokens_seen"]) for r in logged]
    assert curve.val_loss.x[-1] == float(sum(fed))


def test_plot_estimates_tokens_of_rows_without_the_count(tmp_path: Path) -> None:
    """An older run's rows lack tokens_seen: step x batch_size x block_size, from config.resolved.json."""
    data = make_data(tmp_path / "text", chars=4_000)
    run = tmp_path / "old"
    recipe = tmp_path / "lm.toml"
    recipe.write_text('model = "tiny"\nbatch_size = 2\nblock_size = 16\nmax_steps = 2\nwarmup_steps = 0\n'
                      "log_interval = 1\ntensorboard = false\nthreads = 1\n")
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet"]) == 0
    rows = _rows(run)
    assert [r["tokens_seen"] for r in rows if "train_loss" in r] == [32, 64]  # whole windows: 2 x 16 a step
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "tokens_seen"}) + "\n"
                                               for r in rows))
    assert read_curves(run, x="tokens").train_loss.x == [32.0, 64.0]
    # a resumed older run: rows before the resume estimated, those after it counted
    rows = [{k: v for k, v in r.items() if k != "tokens_seen" or r["step"] > 1} for r in rows]
    rows[1]["tokens_seen"] = 50
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_curves(run, x="tokens").train_loss.x == [32.0, 50.0]
    (run / "config.resolved.json").unlink()
    with pytest.raises(GptlabError, match="needs the run's batch_size and block_size"):
        read_curves(run, x="tokens")
