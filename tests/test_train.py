"""The trainer: a falling loss, metrics, exact resume after SIGKILL, SIGTERM checkpoints, batches that don't
depend on how they are split, overrides and one-line CLI errors."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_data, one_line_error, write_recipe
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from gptlab.checkpoint import list_step_checkpoints
from gptlab.cli import main
from gptlab.cli.train import parse_overrides
from gptlab.config import GPTConfig
from gptlab.data import global_batch, micro_batch
from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.train import build_train_config, load_train_config
from gptlab.train.optim import BatchedMuon, FusedAdamW, OptimizerSpec, Schedule, build_optimizers
from gptlab.train.precision import Precision

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _private_hardware_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """The MFU probe measures under whatever else the test machine runs: keep it out of the user's cache."""
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gptlab-cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("train_data"))


def train(recipe: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", *extra])


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def cli_subprocess(*argv: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "gptlab.cli", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


# --- a real run ---------------------------------------------------------------------------------------------
def test_short_run_loss_falls_and_writes_metrics_and_checkpoints(tmp_path: Path, data: Path) -> None:
    run = tmp_path / "run"
    assert train(write_recipe(tmp_path), data, run) == 0
    rows = metrics(run)
    train_rows = [r for r in rows if "train_loss" in r]
    assert {"step", "train_loss", "lr", "tokens_per_sec", "elapsed_sec", "mfu"} <= set(train_rows[0])
    assert [r["step"] for r in train_rows] == list(range(5, 41, 5))
    assert train_rows[-1]["train_loss"] < train_rows[0]["train_loss"] - 0.3
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val_rows] == [20, 40] and val_rows[-1]["val_loss"] < math.log(59)
    assert all(0 < r["mfu"] < 1 and r["tokens_per_sec"] > 0 for r in train_rows)
    # checkpoint layout: safetensors + JSON only, the best one too, and the resolved config
    (step_dir,) = list_step_checkpoints(run)
    assert step_dir.name == "step-0000040"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        ".gptlab",
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
        "tokenizer_meta.json",
    ]
    state = json.loads((step_dir / "state.json").read_text())
    assert state["step"] == 40 and state["best_val_loss"] == pytest.approx(val_rows[-1]["val_loss"])
    best = run / "checkpoints" / "best"  # weights, config and tokenizer; no optimizer state
    assert sorted(p.name for p in best.iterdir()) == [
        ".gptlab",
        "config.json", "model.safetensors", "state.json", "tokenizer_meta.json"]
    assert json.loads((best / "state.json").read_text()) == {"step": 40, "val_loss": val_rows[-1]["val_loss"]}
    resolved = json.loads((run / "config.resolved.json").read_text())
    assert (
        resolved["model"]["vocab_size"] == json.loads((data / "meta.json").read_text())["vocab_size"]
        and resolved["train"]["max_steps"] == 40
        and resolved["data"] == str(data.absolute())  # what `gptlab eval RUN` scores from any folder
    )
    assert not any("_orig_mod" in k for k in load_file(step_dir / "model.safetensors"))


def test_bf16_run_trains_and_its_eval_matches_fp32(tmp_path: Path, data: Path) -> None:
    run = tmp_path / "run"
    assert train(write_recipe(tmp_path), data, run, "--dtype", "bfloat16", "--optimizer", "muon") == 0
    val_bf16 = [r["val_loss"] for r in metrics(run) if "val_loss" in r][-1]
    from gptlab.data import load_split
    from gptlab.evaluation.loss import evaluate_loss
    from gptlab.loading import load_model

    model, _ = load_model(run / "checkpoints" / "step-0000040")
    val_fp32 = evaluate_loss(model, load_split(data, "val"), 32, max_tokens=2048).loss
    assert val_bf16 < 3.5 and abs(val_bf16 - val_fp32) < 0.02


def test_existing_run_needs_resume_and_resume_checks_the_config(tmp_path: Path, data: Path, capsys) -> None:
    recipe, run = write_recipe(tmp_path), tmp_path / "run"
    assert train(recipe, data, run, "--max-steps", "10", "--eval-interval", "0") == 0
    capsys.readouterr()
    assert train(recipe, data, run, "--max-steps", "10") == 2
    assert "--resume" in capsys.readouterr().err
    assert train(recipe, data, run, "--max-steps", "12", "--lr", "1e-2", "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert "lr" in err and "\n" not in err
    assert train(recipe, data, run, "--max-steps", "12", "--n-layer", "3", "--resume") == 2
    err = capsys.readouterr().err.strip()  # the override is named, not the run's intact config.json
    assert "recipe and flags give n_layer=3, the run was trained with n_layer=2" in err and "damaged" not in err
    assert "\n" not in err
    assert (
        train(recipe, data, run, "--max-steps", "12", "--eval-interval", "0", "--resume") == 0
    )  # whitelisted
    assert [p.name for p in list_step_checkpoints(run)] == ["step-0000010", "step-0000012"]


def test_a_finished_run_resumed_as_it_was_evaluates_and_logs_nothing_again(tmp_path: Path, data: Path) -> None:
    """A requeued job (README's Slurm script resumes whenever checkpoints exist) that had already ended: its last
    checkpoint was written after the final evaluation, so the run's metrics stay as they were."""
    recipe, run = write_recipe(tmp_path), tmp_path / "run"
    assert train(recipe, data, run, "--max-steps", "10", "--eval-interval", "5") == 0
    before = (run / "metrics.jsonl").read_text()
    assert train(recipe, data, run, "--max-steps", "10", "--eval-interval", "5", "--resume") == 0
    assert (run / "metrics.jsonl").read_text() == before  # it had its final row twice
    assert train(recipe, data, run, "--max-steps", "12", "--eval-interval", "5", "--resume") == 0
    assert [r["step"] for r in metrics(run) if "val_loss" in r] == [5, 10, 12]


def test_non_finite_loss_stops_with_the_step_named(tmp_path: Path, data: Path, capsys) -> None:
    rc = train(
        write_recipe(tmp_path),
        data,
        tmp_path / "run",
        "--lr",
        "1e30",
        "--grad-clip",
        "0",
        "--warmup-steps",
        "0",
        "--schedule",
        "constant",
    )
    err = capsys.readouterr().err
    assert rc == 2 and "at step" in err and "no checkpoint" in err


# --- exact resume and signals -------------------------------------------------------------------------------
@contextlib.contextmanager
def _killed_on_failure(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """A failing test must not leave its training child running (a 1,000,000-step run would outlive pytest)."""
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    with _killed_on_failure(proc):
        while not predicate():
            assert proc.poll() is None, f"run ended early: {proc.communicate()}"
            assert time.time() < deadline, "timed out"
            time.sleep(0.005)


def test_sigkill_then_resume_is_bit_identical(tmp_path: Path, data: Path) -> None:
    # fp32, dropout on (the torch RNG must be restored too), Muon + AdamW, a decaying schedule
    recipe = write_recipe(
        tmp_path,
        max_steps=150,
        checkpoint_interval=10,
        eval_interval=50,
        dropout=0.1,
        optimizer="muon",
        schedule="wsd",
        log_interval=25,
    )
    run = tmp_path / "run"
    proc = cli_subprocess("train", str(recipe), "--data", str(data), "--out", str(run), "--quiet")
    _wait_for(lambda: len(list_step_checkpoints(run)) >= 1, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = int(list_step_checkpoints(run)[-1].name.split("-")[1])
    assert killed_at < 150
    # the resumed and the reference runs go in-process (same thread count: recipe threads = 1) to save
    # start-ups
    assert train(recipe, data, run, "--resume") == 0
    ref = tmp_path / "ref"
    assert train(recipe, data, ref) == 0
    final_ref = load_file(ref / "checkpoints" / "step-0000150" / "model.safetensors")
    final = load_file(run / "checkpoints" / "step-0000150" / "model.safetensors")
    assert final.keys() == final_ref.keys()
    assert all(torch.equal(final[k], final_ref[k]) for k in final)
    # the metrics of the resumed run continue where the checkpoint left off, without duplicates
    steps = [r["step"] for r in metrics(run) if "train_loss" in r]
    assert steps == [r["step"] for r in metrics(ref) if "train_loss" in r]


def test_sigterm_checkpoints_and_prints_the_resume_command(tmp_path: Path, data: Path) -> None:
    recipe = write_recipe(tmp_path, max_steps=1000000, eval_interval=0)
    run = tmp_path / "run"
    proc = cli_subprocess("train", str(recipe), "--data", str(data), "--out", str(run))
    _wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size > 0, proc)
    proc.send_signal(signal.SIGTERM)
    with _killed_on_failure(proc):
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    (ckpt,) = list_step_checkpoints(run)
    assert "SIGTERM" in err and f"--out {run}" in err and err.strip().endswith("--resume")
    assert str(ckpt) in err


@pytest.mark.parametrize(("env", "launch"), [
    ({}, "gptlab train"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"},
     "torchrun --standalone --nproc-per-node 2 -m gptlab.cli train"),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"},
     "torchrun [this run's torchrun options, on every machine] -m gptlab.cli train"),
])
def test_the_resume_command_launches_as_many_processes_as_the_run(monkeypatch, env: dict, launch: str) -> None:
    """A run stopped under torchrun prints a torchrun command to resume it, not `gptlab train` (one process: an
    FSDP run's model may not fit there, and every rank's dropout stream but rank 0's would be lost)."""
    from gptlab.cli import build_parser
    from gptlab.cli.train import resume_command

    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args, extra = build_parser().parse_known_args(["train", "r.toml", "--data", "d", "--out", "my run", "--lr", "1"])
    args.extra = extra
    assert resume_command(args) == f"{launch} r.toml --data d --out 'my run' --lr 1 --resume"


# --- batches ------------------------------------------------------------------------------------------------
def test_global_batch_is_a_pure_function_of_seed_and_step() -> None:
    data = np.arange(1000, dtype=np.uint16)
    a, b = global_batch(data, 1, 5, 8, 16), global_batch(data, 1, 5, 8, 16)
    assert np.array_equal(a, b) and a.shape == (8, 17) and a.dtype == np.int64
    assert not np.array_equal(a, global_batch(data, 1, 6, 8, 16))
    assert (a[:, 1:] - a[:, :-1] == 1).all()  # contiguous windows
    assert int(a.max()) <= 999
    # splitting over 2 processes x 2 micro-steps covers the global batch exactly once, in order
    parts = [micro_batch(a, r, 2, m, 2) for r in range(2) for m in range(2)]
    assert np.array_equal(np.concatenate(parts), a)


def test_grad_accum_gives_the_same_gradient() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=50))
    tokens = np.random.default_rng(0).integers(0, 50, 500).astype(np.uint16)
    windows = torch.from_numpy(global_batch(tokens, 3, 0, 8, 16))

    def grads(accum: int) -> list[torch.Tensor]:
        model.zero_grad()
        for m in range(accum):
            rows = micro_batch(windows, 0, 1, m, accum)
            (model(rows[:, :-1], rows[:, 1:])[1] / accum).backward()
        return [p.grad.clone() for p in model.parameters()]

    for g1, g2 in zip(grads(1), grads(2), strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_same_seed_same_result_whatever_grad_accum(tmp_path: Path, data: Path) -> None:
    recipe = write_recipe(tmp_path, name="r.toml")
    assert train(recipe, data, tmp_path / "a", "--max-steps", "6", "--eval-interval", "0") == 0
    assert (
        train(recipe, data, tmp_path / "b", "--max-steps", "6", "--eval-interval", "0", "--grad-accum", "2")
        == 0
    )
    la = [r["val_loss"] for r in metrics(tmp_path / "a") if "val_loss" in r]
    lb = [r["val_loss"] for r in metrics(tmp_path / "b") if "val_loss" in r]
    assert la == pytest.approx(lb, abs=1e-4)


# --- configuration ------------------------------------------------------------------------------------------
def test_overrides_parse_by_field_type() -> None:
    raw = parse_overrides(
        [
            "--max-steps",
            "12",
            "--lr=3e-3",
            "--compile",
            "true",
            "--max_time",
            "none",
            "--adam-betas",
            "0.8,0.9",
            "--n-layer",
            "3",
            "--dropout",
            "0.1",
            "--dtype",
            "bfloat16",
            "--n-kv-head",
            "1",
        ]
    )
    cfg = build_train_config({"model": "tiny"}, raw)
    assert (cfg.max_steps, cfg.lr, cfg.compile, cfg.max_time, cfg.adam_betas) == (
        12,
        3e-3,
        True,
        None,
        (0.8, 0.9),
    )
    assert cfg.model_overrides == {"n_layer": 3, "dropout": 0.1, "n_kv_head": 1}
    assert cfg.model_config(vocab_size=65).n_layer == 3 and cfg.dtype == "bfloat16"
    with pytest.raises(GptlabError, match="did you mean max_steps"):
        build_train_config({}, {"max_step": "3"})
    with pytest.raises(GptlabError, match="expected int"):
        build_train_config({}, {"max_steps": "many"})
    with pytest.raises(GptlabError, match="expected int"):
        build_train_config({"max_steps": 1.5})
    with pytest.raises(GptlabError, match="'cosine'"):
        build_train_config({"schedule": "linear"})
    with pytest.raises(GptlabError, match="needs a value"):
        parse_overrides(["--lr"])


@pytest.mark.parametrize(
    ("recipe_text", "extra", "expect"),
    [
        (None, [], "not found"),
        ("model = [", [], "not valid TOML"),
        ('model = "tiny"\nmax_stepz = 3\n', [], "did you mean max_steps"),
        ('model = "tiny"\nlr = "fast"\n', [], "expected float"),
        ('model = "tiny"\n', ["--batch-size", "x"], "expected int"),
        ('model = "nope"\n', [], "unknown preset"),
        ('model = "tiny"\nblock_size = 20000\n', [], "fewer than block_size+1"),
        ('model = "tiny"\n', ["--dtype", "float16", "--device", "cpu"], "float16"),
        ('model = "tiny"\n', ["--n-head", "3"], "divisible"),
    ],
)
def test_cli_errors_are_one_line(tmp_path: Path, data: Path, capsys, recipe_text, extra, expect) -> None:
    recipe = tmp_path / "r.toml"
    if recipe_text is not None:
        recipe.write_text(recipe_text + "threads = 1\n")
    rc = train(recipe, data, tmp_path / "run", *extra)
    assert expect in one_line_error(rc, capsys.readouterr().err)


def test_a_directory_given_as_the_recipe_says_where_it_belongs(tmp_path: Path, data: Path, capsys) -> None:
    run, ckpt, other = tmp_path / "run", tmp_path / "ckpt", tmp_path / "other"
    for d in (run, ckpt, other):
        d.mkdir()
    (run / "config.resolved.json").write_text("{}")  # what a run directory holds (a run that trained)
    (ckpt / "model.safetensors").write_bytes(b"")
    for path, hint in [(data, f"it looks like prepared data, which goes to --data {data}"),
                       (run, f"it looks like a run directory; continue it with its recipe: gptlab train RECIPE.toml "
                             f"--out {run} --resume"),
                       (ckpt, f"it looks like a checkpoint; fine-tune from it with --init-from {ckpt}"),
                       (other, "(recipes live in configs/*.toml)")]:
        err = one_line_error(train(path, data, tmp_path / "out"), capsys.readouterr().err)
        assert f"config file {path} is a directory, not a TOML recipe" in err and hint in err, err
        assert "not found" not in err


def test_missing_data_dir_is_a_one_line_error_in_a_real_process(tmp_path: Path) -> None:
    proc = cli_subprocess(
        "train",
        str(REPO / "configs" / "speedrun_cpu.toml"),
        "--data",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "run"),
    )
    _, err = proc.communicate(timeout=60)
    assert "does not exist" in one_line_error(proc.returncode, err)


def test_recipes_in_configs_load() -> None:
    for path in sorted((REPO / "configs").glob("*.toml")):
        # a fine-tuning recipe names its model on the command line (--init-from)
        cfg = load_train_config(path, {"init_from": "MODEL"} if "lora_rank" in path.read_text() else None)
        assert cfg.model_config(vocab_size=65).vocab_size == 65, path


# --- optimizers --------------------------------------------------------------------------------------------------
def test_gptlab_optimizers_match_torch_optim() -> None:
    torch.manual_seed(0)
    shapes = [(48, 16), (16, 16), (64, 16), (16, 64), (48, 16), (16, 16)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    pairs = [
        (torch.optim.AdamW([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
                           lr=1e-2, betas=(0.9, 0.99), fused=True),
         FusedAdamW([{"params": qs[:2], "weight_decay": 0.1}, {"params": qs[2:], "weight_decay": 0.0}], lr=1e-2,
                    betas=(0.9, 0.99))),
        (torch.optim.Muon(ps, lr=0.03, momentum=0.85, weight_decay=0.01, adjust_lr_fn="original"),
         BatchedMuon(qs, lr=0.03, momentum=0.85, weight_decay=0.01)),
    ]
    for reference, ours in pairs:
        for _ in range(4):
            for p, q in zip(ps, qs, strict=True):
                p.grad = torch.randn(p.shape)
                q.grad = p.grad.clone()
            reference.step()
            ours.step()
        if isinstance(ours, FusedAdamW):  # the same fused kernel: bit-identical
            assert all(torch.equal(p, q) for p, q in zip(ps, qs, strict=True))
        else:  # Newton-Schulz runs in bf16, batched vs one by one: equal up to bf16 rounding
            for p, q in zip(ps, qs, strict=True):
                torch.testing.assert_close(p, q, atol=2e-3, rtol=0)
                q.data.copy_(p.data)


def test_newton_schulz_zero_padding_is_exact_and_large_matrices_stack_by_shape() -> None:
    """The padding stays zero and changes the values only by the order of their sums."""
    from gptlab.train.muon import newton_schulz, newton_schulz_stacks

    shapes = [(48, 16), (16, 16), (64, 16), (16, 64), (12, 40)]
    ((idx, (rows, cols)),) = newton_schulz_stacks(shapes)  # small: one stack, padded to the largest
    assert idx == [0, 1, 2, 3, 4] and (rows, cols) == (16, 64)
    torch.manual_seed(0)
    mats = [torch.randn(min(s), max(s)) for s in shapes]
    padded = torch.zeros(len(mats), rows, cols)
    for j, m in enumerate(mats):
        padded[j, : m.shape[0], : m.shape[1]] = m
    together = newton_schulz(padded, 5, (3.4445, -4.775, 2.0315), 1e-7)
    for j, m in enumerate(mats):
        alone = newton_schulz(m[None], 5, (3.4445, -4.775, 2.0315), 1e-7)[0]
        # the same sums, in an order that may depend on the width (fp32 products): a bf16 step apart at most
        torch.testing.assert_close(together[j, : m.shape[0], : m.shape[1]].float(), alone.float(), rtol=2 ** -7,
                                   atol=1e-6)
        assert not together[j, m.shape[0] :].any() and not together[j, :, m.shape[1] :].any()
    big = [(768, 2304), (768, 768), (3072, 768), (768, 3072), (768, 768)]
    assert newton_schulz_stacks(big) == [([0], (768, 2304)), ([1, 4], (768, 768)), ([2, 3], (768, 3072))]


def test_muon_keeps_a_small_stacks_buffers_and_their_padding_stays_zero() -> None:
    """BatchedMuon writes each step's updates into the views of a kept, zero-padded stack: over steps of matrices
    of several shapes (tall ones transposed in), the padding is still zero and the updates are those of fresh
    buffers (a new optimizer on the same state)."""
    torch.manual_seed(0)
    shapes = [(48, 16), (16, 16), (64, 16), (16, 64)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kept = BatchedMuon(ps, lr=0.03, momentum=0.85)
    for step in range(3):
        fresh = BatchedMuon(qs, lr=0.03, momentum=0.85)  # new buffers, the state carried over
        if step:  # (a copy: the state's tensors would be shared otherwise)
            fresh.load_state_dict(copy.deepcopy(kept.state_dict()))
        for p, q in zip(ps, qs, strict=True):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        kept.step()
        fresh.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, qs, strict=True))
    ((layout),) = kept._layouts.values()
    for j, (rows, cols) in enumerate(shapes):
        for stack in (layout.wide, layout.out):
            assert not stack[j, min(rows, cols) :].any() and not stack[j, :, max(rows, cols) :].any()


@pytest.mark.parametrize(
    ("kind", "impl", "dtype"),
    [("adamw", "torch", "float32"), ("adamw", "gptlab", "float32"), ("muon", "torch", "float32"),
     ("muon", "gptlab", "bfloat16")],  # bfloat16 on the CPU: a bf16 working copy of the model runs the steps
)
def test_frozen_parameters_are_in_no_optimizer_and_never_change(kind: str, impl: str, dtype: str) -> None:
    """A frozen base (requires_grad False, as under adapters) is never stepped or decayed; the rest trains."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=50))
    frozen_prefixes = ("transformer.wte.", "transformer.h.0.")  # the (tied) embedding and the first block
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen_prefixes))
    spec = OptimizerSpec(kind=kind, impl=impl, lr=1e-2, weight_decay=0.1, muon_weight_decay=0.1)
    optimizers = build_optimizers(model, spec)
    grouped = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(grouped) == len(trainable) and {id(p) for p in grouped} == {id(p) for p in trainable}

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    precision = Precision(model, dtype, "cpu", attention_fp32=True, distributed=False)
    tokens = np.random.default_rng(0).integers(0, 50, 500).astype(np.uint16)
    for step in range(3):
        rows = torch.from_numpy(global_batch(tokens, 3, step, 8, 16))
        with precision.autocast():
            _, loss = precision.train_module(rows[:, :-1], rows[:, 1:])
        precision.backward(loss)
        precision.step(optimizers, grad_clip=1.0)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == name.startswith(frozen_prefixes), name

    # nothing to train: no optimizer is built over an empty parameter list
    if kind == "muon":  # only vectors trainable: AdamW alone, no Muon
        for p in model.parameters():
            p.requires_grad_(p.dim() == 1)
        assert [type(o).__name__ for o in build_optimizers(model, spec)] == [
            "FusedAdamW" if impl == "gptlab" else "AdamW"]
    model.requires_grad_(False)
    with pytest.raises(GptlabError, match="no trainable parameters"):
        build_optimizers(model, spec)


def test_schedules() -> None:
    cosine = Schedule(warmup_steps=4, kind="cosine", min_lr=0.1)
    assert [cosine.multiplier(s, 0.0) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine.multiplier(10, 0.0) == 1.0 and cosine.multiplier(10, 1.0) == pytest.approx(0.1)
    assert cosine.multiplier(10, 0.5) == pytest.approx(0.55) and cosine.multiplier(10, 2.0) == pytest.approx(0.1)
    wsd = Schedule(warmup_steps=0, kind="wsd", min_lr=0.0, decay_fraction=0.2)
    assert wsd.multiplier(5, 0.8) == 1.0 and wsd.multiplier(5, 0.9) == pytest.approx(0.5)
    assert Schedule(warmup_steps=0, kind="constant").multiplier(100, 0.9) == 1.0


def test_recipes_load_without_torch() -> None:
    """Checking a recipe (config.py, and the package's __init__) must not pay for importing torch."""
    code = "import sys, gptlab.train; gptlab.train.load_train_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_plain_run_imports_only_what_it_uses(tmp_path: Path, data: Path) -> None:
    """A fresh model trained on prepared text loads no sampling engine (GRPO's), model loading or format
    conversion (init_from's), quantization (QLoRA's) or data preparation: start-up every run would pay for."""
    recipe = write_recipe(tmp_path, max_steps=2, warmup_steps=0, eval_interval=0, log_interval=1)
    unused = ("gptlab.generation.engine", "gptlab.loading", "gptlab.interop", "gptlab.qlora", "gptlab.quantize",
              "gptlab.data.preparation", "gptlab.data.records")
    code = (f"import sys\nfrom gptlab.cli import main\n"
            f"assert main(['train', {str(recipe)!r}, '--data', {str(data)!r}, '--out', {str(tmp_path / 'run')!r}, "
            f"'--quiet']) == 0\nprint([m for m in sys.modules if m.startswith({unused!r})])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --- distributed -----------------------------------------------------------------------------------------------------
def test_torchrun_ddp_matches_one_process(tmp_path: Path, data: Path) -> None:
    """2 processes (gloo) x 4 rows see the same global batches as 1 process x 2 micro-steps x 4 rows."""
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, log_interval=5)
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptlab.cli",
           "train", str(recipe), "--data", str(data), "--out", str(ddp), "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert train(recipe, data, tmp_path / "one", "--grad-accum", "2") == 0
    (val_ddp,) = [r["val_loss"] for r in metrics(ddp) if "val_loss" in r]
    (val_one,) = [r["val_loss"] for r in metrics(tmp_path / "one") if "val_loss" in r]
    assert val_ddp == pytest.approx(val_one, abs=1e-4)
    train_ddp = [r["train_loss"] for r in metrics(ddp) if "train_loss" in r]
    train_one = [r["train_loss"] for r in metrics(tmp_path / "one") if "train_loss" in r]
    assert train_ddp == pytest.approx(train_one, abs=1e-4)
    assert len(list_step_checkpoints(ddp)) == 1  # rank 0 alone writes


@pytest.mark.parametrize("impl", ["gptlab", "torch"])
def test_torchrun_muon_splits_newton_schulz_and_matches_one_process(tmp_path: Path, data: Path, impl: str) -> None:
    """Muon under DDP: each of 2 processes orthogonalizes its own matrices and gathers the other's (P7); the run
    follows 1 process x 2 micro-steps, and its checkpoint resumes on 1 process (the same optimizer class)."""
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, log_interval=5, optimizer="muon",
                          optimizer_impl=impl, checkpoint_interval=5, keep_last=2)
    _torchrun(recipe, data, tmp_path / "ddp")
    assert train(recipe, data, tmp_path / "one", "--grad-accum", "2") == 0
    assert _losses(tmp_path / "ddp") == pytest.approx(_losses(tmp_path / "one"), abs=1e-4)
    (val_ddp,) = [r["val_loss"] for r in metrics(tmp_path / "ddp") if "val_loss" in r]
    (val_one,) = [r["val_loss"] for r in metrics(tmp_path / "one") if "val_loss" in r]
    assert val_ddp == pytest.approx(val_one, abs=1e-4)
    resumed = _from_step_5(tmp_path / "ddp", tmp_path / "resumed")
    assert train(recipe, data, resumed, "--grad-accum", "2", "--resume") == 0
    assert _losses(resumed)[-1] == pytest.approx(_losses(tmp_path / "one")[-1], abs=1e-4)


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_torchrun_evaluates_the_whole_split_in_shares(tmp_path: Path, data: Path, distributed: str) -> None:
    """eval_tokens unset: the whole val split (187 windows of 32 and a shorter one), each of 2 processes scoring
    its half in batches of 4 (24 forwards on one, 25 on the other: FSDP's gathers need the one-token forward that
    evens them) and one all-reduce summing: the val losses of one process (P8)."""
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=5, log_interval=5, eval_batch_size=4)
    recipe.write_text("".join(line + "\n" for line in recipe.read_text().splitlines()
                              if not line.startswith("eval_tokens")))
    _torchrun(recipe, data, tmp_path / "two", "--distributed", distributed)
    assert train(recipe, data, tmp_path / "one", "--grad-accum", "2") == 0
    val_two = [r["val_loss"] for r in metrics(tmp_path / "two") if "val_loss" in r]
    val_one = [r["val_loss"] for r in metrics(tmp_path / "one") if "val_loss" in r]
    assert len(val_one) == 2 and val_two == pytest.approx(val_one, abs=1e-4)


# rank 1's clock runs 1.5x fast (a busy process, a slower evaluation): then each process prints its step and a
# digest of its weights
_SKEWED_CLOCK = """
import hashlib, os, sys, time, types
import gptlab.train.trainer as trainer
if os.environ["RANK"] == "1":
    trainer.time = types.SimpleNamespace(perf_counter=lambda: 1.5 * time.perf_counter())
run = trainer.Trainer._train
def _train(self, log, bar):
    code = run(self, log, bar)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in self.model.parameters())).hexdigest()
    print(f"rank {os.environ['RANK']}: step {self.step} weights {digest}", file=sys.stderr)
    return code
trainer.Trainer._train = _train
from gptlab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_under_a_time_budget_every_process_takes_rank_0s_clock(tmp_path: Path, data: Path) -> None:
    """max_time under DDP: the clock sets each step's lr (the decay ends on time) and when the run stops, so every
    process must read the same one, rank 0's, even when their own clocks differ (rank 1's runs fast here) or their
    evaluations take different times (rank 0 alone writes best/). Else the replicas step with different lrs and
    drift apart, or one process stops while the other waits in the next step's collectives."""
    script = tmp_path / "skewed.py"
    script.write_text(_SKEWED_CLOCK)
    recipe = write_recipe(tmp_path, max_steps=10_000, max_time=1.5, eval_interval=3, eval_tokens=256, log_interval=1,
                          distributed_timeout=30)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "train",
           str(recipe), "--data", str(data), "--out", str(tmp_path / "run"), "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ends = sorted(line.split(": ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("rank "))
    assert len(ends) == 2 and ends[0] == ends[1], ends
    (last,) = list_step_checkpoints(tmp_path / "run")
    assert json.loads((last / "state.json").read_text())["elapsed_sec"] >= 1.5  # it ended on the clock


def _from_step_5(run: Path, copy: Path) -> Path:
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-0000010")
    return copy


def test_torchrun_fsdp_matches_one_process_and_resumes(tmp_path: Path, data: Path) -> None:
    """FSDP over 2 processes (gloo), 2 micro-steps each, follows 1 process x 4 micro-steps; its checkpoint holds
    whole tensors (gathered from the shards), and resumed, it goes on as the resumed single process does."""
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, log_interval=5)
    fsdp = tmp_path / "fsdp"

    def torchrun(*extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "gptlab.cli", "train", str(recipe), "--data", str(data), "--out", str(fsdp), "--quiet",
               "--distributed", "fsdp", "--grad-accum", "2", *extra]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]

    torchrun()
    assert train(recipe, data, tmp_path / "one", "--grad-accum", "4") == 0
    train_fsdp = [r["train_loss"] for r in metrics(fsdp) if "train_loss" in r]
    train_one = [r["train_loss"] for r in metrics(tmp_path / "one") if "train_loss" in r]
    assert train_fsdp == pytest.approx(train_one, abs=1e-4)
    (ckpt_dir,) = list_step_checkpoints(fsdp)  # rank 0 alone writes, whole tensors
    whole = load_file(str(ckpt_dir / "model.safetensors"))
    one = load_file(str(list_step_checkpoints(tmp_path / "one")[0] / "model.safetensors"))
    assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in one.items()}
    assert all(torch.allclose(whole[k], one[k], atol=1e-4) for k in one)
    optimizer = load_file(str(ckpt_dir / "optimizer.safetensors"))
    assert optimizer["opt0.0.exp_avg"].shape == one["transformer.h.0.attn.c_attn.weight"].shape
    torchrun("--resume", "--max-steps", "14")  # loads the whole tensors back into shards
    assert train(recipe, data, tmp_path / "one", "--grad-accum", "4", "--max-steps", "14", "--resume") == 0
    val_fsdp = [r["val_loss"] for r in metrics(fsdp) if "val_loss" in r]
    val_one = [r["val_loss"] for r in metrics(tmp_path / "one") if "val_loss" in r]
    assert len(val_fsdp) == 2 and val_fsdp == pytest.approx(val_one, abs=1e-4)
    with pytest.raises(GptlabError, match="muon"):
        build_train_config({"distributed": "fsdp", "optimizer": "muon"})


def _torchrun(recipe: Path, data: Path, out: Path, *extra: str, nproc: int = 2) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "gptlab.cli", "train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _from_step_4(run: Path, copy: Path) -> Path:
    """A copy of a run stopped at its step-4 checkpoint (its step-8 one removed): --resume continues from there."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-0000008")
    return copy


def _losses(run: Path) -> list[float]:
    return [r["train_loss"] for r in metrics(run) if "train_loss" in r]


def test_a_checkpoint_from_before_per_rank_rng_states_and_the_batch_keys_resumes_exactly(
        tmp_path: Path, data: Path) -> None:
    """state.json as gptlab wrote it before: one "torch" state (and "cuda", one per visible GPU), a config without
    micro_batch_size / distributed_timeout, and a config hash taken over other keys. It resumes, bit-identically."""
    recipe = write_recipe(tmp_path, max_steps=8, checkpoint_interval=4, eval_interval=0, dropout=0.1)
    ref = tmp_path / "ref"
    assert train(recipe, data, ref) == 0
    old = _from_step_4(ref, tmp_path / "old")
    path = old / "checkpoints" / "step-0000004" / "state.json"
    state = json.loads(path.read_text())
    state["rng"] = {"torch": state["rng"]["torch"]}
    for key in ("micro_batch_size", "distributed_timeout"):
        del state["config"][key]
    state["config"]["grad_accum"], state["config_hash"] = 1, "0123456789abcdef"
    path.write_text(json.dumps(state))
    assert train(recipe, data, old, "--resume") == 0
    final, final_ref = (load_file(r / "checkpoints" / "step-0000008" / "model.safetensors") for r in (old, ref))
    assert all(torch.equal(final[k], final_ref[k]) for k in final_ref)


def test_torchrun_resume_with_dropout_on_2_processes_is_exact_and_on_1_or_from_1_continues(
        tmp_path: Path, data: Path) -> None:
    """Dropout on, micro_batch_size 2 (2 micro-steps on 2 processes, 4 on 1). Every rank has its own dropout
    stream, saved in the checkpoint: resumed on 2 processes the run is bit-identical to the uninterrupted one.
    Resumed from 2 processes on 1, or from 1 on 2, it continues with the same global batches (a function of (seed,
    step)) but not the same dropout masks: rows move to another process or micro-step, and a stream a process
    did not have (rank 1's on 1 process) cannot be drawn from. So those are only close."""
    recipe = write_recipe(tmp_path, max_steps=8, checkpoint_interval=4, eval_interval=0, log_interval=1,
                          dropout=0.1, micro_batch_size=2, warmup_steps=2)
    ref2, ref1 = tmp_path / "ref2", tmp_path / "ref1"
    _torchrun(recipe, data, ref2)
    state = json.loads((ref2 / "checkpoints" / "step-0000004" / "state.json").read_text())
    assert len(state["rng"]["ranks"]) == 2 and state["rng"]["ranks"][1]["torch"] != state["rng"]["torch"]
    assert json.loads((ref2 / "config.resolved.json").read_text())["train"]["grad_accum"] == 2

    # 2 -> 2: exact
    two = _from_step_4(ref2, tmp_path / "two")
    _torchrun(recipe, data, two, "--resume")
    assert _losses(two) == _losses(ref2)
    final, final_ref = (load_file(r / "checkpoints" / "step-0000008" / "model.safetensors") for r in (two, ref2))
    assert all(torch.equal(final[k], final_ref[k]) for k in final_ref)

    # 2 -> 1: the same steps, 4 micro-steps each; rank 0's stream goes on, rank 1's is gone
    one = _from_step_4(ref2, tmp_path / "one")
    assert train(recipe, data, one, "--resume") == 0
    assert json.loads((one / "config.resolved.json").read_text())["train"]["grad_accum"] == 4
    assert _losses(one)[:4] == _losses(ref2)[:4] and _losses(one)[4:] != _losses(ref2)[4:]
    assert _losses(one) == pytest.approx(_losses(ref2), abs=0.05)

    # 1 -> 2: rank 0 takes the saved stream, rank 1 one of its own (none was saved for it)
    assert train(recipe, data, ref1) == 0
    grown = _from_step_4(ref1, tmp_path / "grown")
    _torchrun(recipe, data, grown, "--resume")
    assert _losses(grown)[:4] == _losses(ref1)[:4]
    assert _losses(grown) == pytest.approx(_losses(ref1), abs=0.05)
    state = json.loads((grown / "checkpoints" / "step-0000008" / "state.json").read_text())
    assert len(state["rng"]["ranks"]) == 2 and state["rng"]["ranks"][1]["torch"] != state["rng"]["torch"]


def test_a_check_failing_on_one_node_stops_the_other(tmp_path: Path, data: Path) -> None:
    """Two "nodes" (torchrun each, one process each) without a shared filesystem: node 1's --out already holds
    checkpoints. Its process fails that check; the process of node 0 must not go on to the first collective and
    wait there for it, but stop too, each with a one-line error. (Without the vote, gloo notices the peer's closed
    socket and node 0 fails with an internal error and a traceback; NCCL would wait out its timeout.)"""
    recipe = write_recipe(tmp_path, max_steps=6, eval_interval=0)
    held = tmp_path / "held"
    assert train(recipe, data, held) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def node(rank: int, out: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "gptlab.cli",
               "train", str(recipe), "--data", str(data), "--out", str(out), "--quiet"]
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    nodes = [node(0, tmp_path / "fresh"), node(1, held)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode != 0 for p in nodes), errs
    assert "error: " + str(held) + " already holds checkpoints" in errs[1]
    assert "error: rank 1 of 2 processes failed the checks before training (its own error says why)" in errs[0]
    assert not list_step_checkpoints(tmp_path / "fresh")


def test_init_from_fine_tunes_a_previous_run(tmp_path: Path, data: Path, capsys) -> None:
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0)
    assert train(recipe, data, tmp_path / "base") == 0
    base_val = [r["val_loss"] for r in metrics(tmp_path / "base") if "val_loss" in r][-1]
    assert train(recipe, data, tmp_path / "tuned", "--init-from", str(tmp_path / "base"), "--lr", "1e-3") == 0
    rows = metrics(tmp_path / "tuned")
    assert rows[0]["train_loss"] < base_val + 0.3  # starts from the trained weights, not from scratch (~4.1)
    assert train(recipe, data, tmp_path / "bad", "--init-from", str(tmp_path / "base"), "--n-layer", "3") == 2
    assert "only dropout may change" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retained_freed_memory_stops_the_page_faults_of_big_tensors() -> None:
    """In a fresh process: 64 MB tensors made and dropped fault in new pages each time, until
    retain_freed_memory (which `gptlab train` calls) has glibc keep the freed blocks."""
    code = (
        "import resource, torch\n"
        "from gptlab.hardware import retain_freed_memory\n"
        "def faults():\n"
        "    for _ in range(10): torch.ones(2**24)\n"
        "    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(5): torch.ones(2**24)\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0\n"
        "before = faults(); applied = retain_freed_memory(); after = faults()\n"
        "print(before, applied, after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    before, applied, after = int(out[0]), out[1] == "True", int(out[2])
    assert applied
    assert before >= 5 * 2**24 * 4 // 4096 // 2  # about a fault per 4 KB page of every 64 MB tensor
    assert after < 1000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_bounded_retention_reuses_step_sized_blocks_and_bursts() -> None:
    """`gptlab serve`'s form (retain_freed_memory(trim_above=...)): logits-sized blocks made and dropped each step
    do not fault in new pages, and bursts over the bound, freed, do not pile up (the heap reuses the memory, and
    trims it where no live block sits above it: one may stay reserved, pinned)."""
    code = (
        "import os, resource, torch\n"
        "from gptlab.hardware import retain_freed_memory\n"
        "fd = os.open('/proc/self/statm', os.O_RDONLY)\n"
        "def rss(): return int(os.pread(fd, 64, 0).split()[1]) * 4096\n"
        "applied = retain_freed_memory(trim_above=64 << 20)\n"
        "for _ in range(10): torch.ones(64, 50257) / torch.ones(64, 50257)\n"
        "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(10): torch.ones(64, 50257) / torch.ones(64, 50257)\n"
        "faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0\n"
        "burst = torch.ones(2**26); del burst; first = rss()\n"
        "for _ in range(5): burst = torch.ones(2**26); del burst; keep = [bytearray(100) for _ in range(50)]\n"
        "print(applied, faults, (rss() - first) >> 20)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) < 1000  # 30 blocks of 12.9 MB: ~94,000 faults if each came from a fresh mmap
    assert int(out[2]) < 320  # five more 256 MB bursts, small blocks between them: at most one stays reserved


def test_serve_keeps_freed_memory_up_to_its_bound() -> None:
    from gptlab.cli import build_parser
    from gptlab.cli.serve import RETAIN_FREED_UP_TO

    assert build_parser().parse_args(["serve", "some-run"]).retain_memory == RETAIN_FREED_UP_TO


def test_the_mfu_probe_leaves_torch_random_stream_alone() -> None:
    """Whether a run probes the machine or finds the result cached, its dropout masks must be the same."""
    from gptlab.hardware import _probe

    torch.manual_seed(3)
    before = torch.get_rng_state()
    _probe(torch.device("cpu"), torch.float32, 64, seconds=0.01)
    assert torch.equal(torch.get_rng_state(), before)


# --- the learning-rate schedule decays over the steps after warm-up (issue 12) -----------------------------------
def nanogpt_lr(step: int, warmup: int, decay_steps: int, min_lr: float) -> float:
    """nanoGPT's get_lr as a fraction of the peak, with gptlab's warm-up ((s + 1) / warmup: peak on its last
    step): cosine from 1 to min_lr over (step - warmup) / (decay_steps - warmup)."""
    if step < warmup:
        return (step + 1) / warmup
    ratio = min((step - warmup) / (decay_steps - warmup), 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - min_lr)


def test_cosine_decays_over_the_steps_after_warmup() -> None:
    sched, warmup, n = Schedule(warmup_steps=10, kind="cosine", min_lr=0.1), 10, 110

    def lr(s: int) -> float:
        return sched.multiplier(s, sched.step_progress(s, n))

    for s in [0, 4, 9, 10, 11, 35, 60, 85, 109, 110, 200]:
        assert lr(s) == pytest.approx(nanogpt_lr(s, warmup, n, 0.1), abs=1e-12), s
    assert lr(9) == lr(10) == 1.0  # the peak on warm-up's last step and on the first decay step
    assert 1.0 - lr(11) < 1e-3  # continuous: one step of 100 takes off (1 - cos(pi / 100)) / 2 * 0.9
    assert lr(60) == pytest.approx(0.55) and lr(110) == pytest.approx(0.1)  # half way: halfway down; the end
    # the bug: the cosine spanned the warm-up, so the first decay step was already below the peak
    assert lr(10) > 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 10 / n))
    # progress by the clock: 0 when warm-up ended, 1 at the end of the budget
    assert Schedule.time_progress(3.0, 10.0, 3.0) == 0.0 and Schedule.time_progress(6.5, 10.0, 3.0) == 0.5
    assert Schedule.time_progress(12.0, 10.0, 3.0) == 1.0 and Schedule.time_progress(5.0, 4.0, 4.5) == 1.0
    assert sched.step_progress(3, 8) == 1.0  # a run shorter than its warm-up has nothing left to decay


def test_wsd_and_linear_decay_also_start_after_warmup() -> None:
    """decay_fraction = 1 is the linear schedule: warm-up, then straight down to min_lr, with no jump."""
    linear = Schedule(warmup_steps=20, kind="wsd", min_lr=0.0, decay_fraction=1.0)
    lrs = [linear.multiplier(s, linear.step_progress(s, 100)) for s in range(101)]
    assert lrs[19] == lrs[20] == 1.0 and lrs[60] == pytest.approx(0.5) and lrs[100] == 0.0
    assert max(abs(a - b) for a, b in zip(lrs[20:-1], lrs[21:], strict=True)) == pytest.approx(1 / 80)
    wsd = Schedule(warmup_steps=20, kind="wsd", min_lr=0.2, decay_fraction=0.25)  # stable to step 80, then down
    assert [wsd.multiplier(s, wsd.step_progress(s, 100)) for s in (79, 80, 90, 100)] == pytest.approx(
        [1.0, 1.0, 0.6, 0.2])


def _lrs(run: Path, peak: float) -> dict[int, float]:
    """Each logged step's multiplier, by the 0-based step it was used for."""
    return {r["step"] - 1: r["lr"] / peak for r in metrics(run) if "lr" in r}


def test_trainer_schedules_by_steps_and_by_time_from_the_end_of_warmup(tmp_path: Path, data: Path,
                                                                       monkeypatch) -> None:
    """Each step takes exactly 1 s of a fake clock: a 10 s budget with 3 warm-up steps decays from the 3 s mark
    to 10 s, each step taking its progress at its end (the last one is at min_lr); a resumed run picks up the
    time warm-up ended from its checkpoint (or, from an older checkpoint, estimates it from equal steps)."""
    import types

    from gptlab.train import trainer

    clock = [0.0]
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real_step = trainer.Trainer.train_step

    def one_second_step(self: trainer.Trainer) -> float:
        clock[0] += 1.0
        return real_step(self)

    monkeypatch.setattr(trainer.Trainer, "train_step", one_second_step)
    recipe = write_recipe(tmp_path, warmup_steps=3, min_lr=0.1, log_interval=1, eval_interval=0, eval_tokens=256)

    # by steps: 13 steps, the cosine over steps 3..13
    assert train(recipe, data, tmp_path / "steps", "--max-steps", "13") == 0
    lrs = _lrs(tmp_path / "steps", 3e-3)
    assert sorted(lrs) == list(range(13))
    assert all(lrs[s] == pytest.approx(nanogpt_lr(s, 3, 13, 0.1)) for s in lrs)

    # by time: 10 steps of 1 s; step s ends at s + 1 s, so its progress is (s + 1 - 3) / (10 - 3)
    def timed(s: int, budget: float) -> float:
        return nanogpt_lr(s, 3, 3, 0.1) if s < 3 else nanogpt_lr(s + 1, 3, budget, 0.1)

    assert train(recipe, data, tmp_path / "time", "--max-time", "10", "--max-steps", "1000") == 0
    lrs = _lrs(tmp_path / "time", 3e-3)
    assert sorted(lrs) == list(range(10))
    assert all(lrs[s] == pytest.approx(timed(s, 10)) for s in lrs)
    assert lrs[2] == 1.0 and lrs[3] == pytest.approx(nanogpt_lr(1, 0, 7, 0.1)) and lrs[9] == pytest.approx(0.1)
    (ckpt_dir,) = list_step_checkpoints(tmp_path / "time")
    state = json.loads((ckpt_dir / "state.json").read_text())
    assert state["warmup_elapsed_sec"] == 3.0 and state["elapsed_sec"] == 10.0

    # resumed with a longer budget: the decay is stretched to 17 s from the same 3 s mark
    import shutil

    shutil.copytree(tmp_path / "time", tmp_path / "old")
    assert train(recipe, data, tmp_path / "time", "--max-time", "17", "--max-steps", "1000", "--resume") == 0
    lrs = _lrs(tmp_path / "time", 3e-3)
    assert sorted(lrs) == list(range(17)) and all(lrs[s] == pytest.approx(timed(s, 17)) for s in range(11, 17))
    assert lrs[10] == pytest.approx(timed(9, 17))  # a resumed run's first step has no step time to look ahead by
    (old_dir,) = list_step_checkpoints(tmp_path / "old")  # a checkpoint written before warmup_elapsed_sec
    state = json.loads((old_dir / "state.json").read_text())
    del state["warmup_elapsed_sec"]
    (old_dir / "state.json").write_text(json.dumps(state))
    assert train(recipe, data, tmp_path / "old", "--max-time", "17", "--max-steps", "1000", "--resume") == 0
    assert _lrs(tmp_path / "old", 3e-3) == pytest.approx(lrs)


# --- MFU counts the FLOPs that run: no embedding lookups (issue 12) ----------------------------------------------
def test_flops_per_token_counts_matmuls_head_and_attention_not_embeddings() -> None:
    """6 x (every Linear weight in the blocks + the LM head) + causal attention 6 * L * H * hs * T (q k^T and
    a v: 2 * hs FLOPs each per key forward, 3x that with backward, over T / 2 keys per query on average)."""
    from gptlab.flops import flops_per_token, parameter_breakdown

    # pocket, untied: 6 layers, 6 query / 2 kv heads of 64, width 384, relu2 MLP 1536, vocab 50257, T 256
    per_layer = 384 * (6 + 2 * 2) * 64 + 384 * 384 + 384 * 1536 + 1536 * 384
    pocket = GPTConfig.preset("pocket")
    expected = 6 * (6 * per_layer + 384 * 50257) + 6 * 6 * 6 * 64 * 256
    assert expected == 175_954_176 and flops_per_token(pocket, 256) == expected
    assert flops_per_token(pocket, 256, training=False) == expected / 3
    # pythia-160m: 12 layers, 12 heads of 64, width 768, gelu MLP 3072 (biases and norms not counted), T 2048
    per_layer = 768 * 3 * 768 + 768 * 768 + 768 * 3072 + 3072 * 768
    pythia = GPTConfig.preset("pythia-160m")
    expected = 6 * (12 * per_layer + 768 * 50304) + 6 * 12 * 12 * 64 * 2048
    assert expected == 854_654_976 and flops_per_token(pythia, 2048) == expected
    # the old count, 6 x all parameters + 6 * L * T * C, was 1.66x (pocket) and 1.27x (pythia) too high
    assert 6 * parameter_breakdown(pocket)["total"] + 6 * 6 * 256 * 384 == pytest.approx(1.658 * 175_954_176, rel=1e-3)
    # a gated MLP's c_fc is twice as wide: pocket-swiglu's hidden size is 1024
    swiglu = GPTConfig.preset("pocket-swiglu")
    per_layer = 384 * (6 + 2 * 2) * 64 + 384 * 384 + 384 * 2 * 1024 + 1024 * 384
    assert flops_per_token(swiglu, 256) == 6 * (6 * per_layer + 384 * 50257) + 6 * 6 * 6 * 64 * 256

    for cfg, T in ((pocket, 256), (pythia, 2048)):
        base = flops_per_token(cfg, T)
        # the vocabulary matters only through the head's matmul; the lookup into the table costs nothing
        assert flops_per_token(cfg.replace(vocab_size=cfg.vocab_size + 1000), T) == base + 6 * cfg.n_embd * 1000
        # a learned position table is a lookup too, and tying the head changes no matmul
        assert flops_per_token(cfg.replace(position="learned"), T) == base
        assert flops_per_token(cfg.replace(tie_embeddings=not cfg.tie_embeddings), T) == base
    # sliding-window layers count the band they attend: w - w^2 / (2T) keys per query (T / 2 when w >= T)
    attention = 6 * 6 * 6 * 64 * 256
    assert flops_per_token(pocket.replace(sliding_window=256), 256) == 175_954_176
    windowed = flops_per_token(pocket.replace(sliding_window=64), 256)
    assert windowed == 175_954_176 - attention + attention * (64 - 64 * 64 / 512) / 128


def _exact_newton_schulz(g: torch.Tensor, steps: int, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """The iteration as Muon writes it, in fp64 on the normalized wide orientation (the reference)."""
    a, b, c = coefficients
    x = g.double()
    x = x.mT if x.size(-2) > x.size(-1) else x
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if g.size(-2) > g.size(-1) else x


def test_newton_schulz_on_a_cpu_without_bf16_units_runs_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where bf16 matmuls are emulated (AVX2) the iteration runs in fp32: its bf16 result is the exact iteration's
    rounded (within one bf16 step), where the bf16 iteration's is several steps off."""
    from gptlab.train import muon as optim

    torch.manual_seed(0)
    coefficients = (3.4445, -4.775, 2.0315)
    for g in (torch.randn(3, 24, 16), torch.randn(2, 16, 64), torch.randn(1, 64, 256)):
        exact = _exact_newton_schulz(g, 5, coefficients)
        monkeypatch.setattr(optim, "native_low_precision_matmul", lambda dtype: False)
        emulated = optim.newton_schulz(g, 5, coefficients, 1e-7)
        monkeypatch.setattr(optim, "native_low_precision_matmul", lambda dtype: True)
        monkeypatch.setattr(optim, "_native_ops", lambda x: None)  # ATen's bf16 products
        native = optim.newton_schulz(g, 5, coefficients, 1e-7)
        assert native.dtype == emulated.dtype == torch.bfloat16 and native.shape == emulated.shape == g.shape
        assert ((emulated.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
        assert (native.double() - exact).abs().max() > 4 * (emulated.double() - exact).abs().max()


@settings(max_examples=30, deadline=None)
@given(stack=st.integers(1, 3), rows=st.integers(1, 48), cols=st.integers(1, 160), steps=st.integers(0, 6),
       seed=st.integers(0, 1000))
def test_both_forms_of_the_fp32_iteration_are_the_exact_one(stack: int, rows: int, cols: int, steps: int,
                                                            seed: int) -> None:
    """`newton_schulz_fp32`'s Gram form (the iteration on r x r matrices) and the standard one, on any shape
    and number of steps: the fp64 iteration's values within fp32 rounding; the Gram form's on the wide matrices
    "auto" gives it (cols > 1.5 rows). Elsewhere within the bf16 rounding the result gets: A = X X^T squares the
    condition number, and a nearly square matrix after 6 steps was ~3e-4 off (2 of 3,000 random cases)."""
    from gptlab.train.muon import newton_schulz_fp32

    coefficients = (3.4445, -4.775, 2.0315)
    g = torch.randn(stack, min(rows, cols), max(rows, cols), generator=torch.Generator().manual_seed(seed))
    exact = _exact_newton_schulz(g, steps, coefficients)
    x = g / g.norm(dim=(-2, -1), keepdim=True)
    wide = 2 * max(rows, cols) > 3 * min(rows, cols)
    for form in ("gram", "standard", "auto"):
        fp32 = form != "gram" or wide
        torch.testing.assert_close(newton_schulz_fp32(x, steps, coefficients, form).double(), exact,
                                   atol=2e-5 if fp32 else 2 ** -9, rtol=1e-4 if fp32 else 2 ** -8)


def test_dtype_auto_takes_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    from gptlab.train import setup

    monkeypatch.setattr(setup, "native_low_precision_matmul", lambda dtype: True)
    assert setup.resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(setup, "native_low_precision_matmul", lambda dtype: False)
    assert setup.resolve_dtype("auto", "cpu") == "float32"
    assert setup.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # an explicit choice is kept


@pytest.mark.parametrize("tie", [True, False])
def test_a_fresh_model_is_materialized_as_to_empty_would(tie: bool) -> None:
    """build_model gives the meta-built model storage without Module.to_empty (whose meta empty_like imports
    torch's symbolic shapes): the same parameters, names, dtypes and initial values as to_empty then
    init_weights, on no meta tensor, and a tied head still the embedding's one Parameter (counted once)."""
    from gptlab.train.setup import build_model, init_weights

    cfg = build_train_config({"model": "tiny", "n_embd": 32, "n_head": 2, "n_kv_head": 2, "block_size": 16,
                              "seed": 5, "tie_embeddings": tie})
    ours = build_model(cfg, 50, "cpu")
    with torch.device("meta"):
        theirs = GPT(cfg.model_config(50)).train()
    theirs.to_empty(device="cpu")
    if tie:
        theirs.lm_head.weight = theirs.transformer.wte.weight
    init_weights(theirs, cfg.seed)
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
    assert (ours.lm_head.weight is ours.transformer.wte.weight) == tie
    assert len(list(ours.parameters())) == len(list(theirs.parameters()))
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert all(p.requires_grad for p in ours.parameters())
