"""A training loop that never waits on the device (issue 24): how often the host reads a tensor's value back.

On a GPU every such read (`float(t)`, `int(t)`, `if t:`, `.item()`, `.tolist()`) makes the host wait until the
device has run everything queued before it. On the CPU the same reads are counted: `aten._local_scalar_dense`
(what every scalar read dispatches to) through a TorchDispatchMode, and `Tensor.tolist` beside it. Also here: a
non-finite loss never steps the optimizer although nobody reads it at once, and the batches prepared ahead.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_data, write_recipe
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from gptlab.checkpoint import list_step_checkpoints
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.train import Trainer, load_train_config
from gptlab.train.batches import StepFeed, TokenSplit, step_batch
from gptlab.train.optim import BatchedMuon, FusedAdamW, set_lr, step_optimizers
from gptlab.train.precision import Precision

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("sync_data"))


@pytest.fixture(autouse=True)
def _private_hardware_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gptlab-cache"))


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        real_tolist = torch.Tensor.tolist

        def tolist(t: torch.Tensor):  # noqa: ANN202 - a list, or a number
            self.count += 1
            return real_tolist(t)

        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(torch.Tensor, "tolist", tolist)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._patch.undo()
        super().__exit__(*exc)


def trainer(root: Path, data: Path, name: str = "run", **changes: object) -> Trainer:
    recipe = write_recipe(root, name=f"{name}.toml", **{"eval_interval": 0, **changes})
    return Trainer(load_train_config(recipe), data, root / name, quiet=True)


# --- reads per step ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "impl", "dtype", "most"),
    [("adamw", "torch", "float32", 6), ("adamw", "gptlab", "bfloat16", 6), ("muon", "gptlab", "float32", 6),
     # torch.optim.Muon takes no found_inf: skipping it after a non-finite loss reads that flag once a step
     ("muon", "torch", "float32", 20 + 6)],
)
def test_training_reads_the_device_only_at_log_rows(tmp_path: Path, data: Path, monkeypatch, kind: str, impl: str,
                                                    dtype: str, most: int) -> None:
    """20 steps at log_interval 10: the losses are read at the two log rows, at most 0.3 reads a step (the
    trainer read 5 a step before: the token-id check's aminmax (2 per micro-step: the ids and the targets) and
    the loss), and none inside train_step. Evaluation and checkpoints, which read values anyway, are left out."""
    from gptlab.train import runlog

    t = trainer(tmp_path, data, max_steps=20, log_interval=10, checkpoint_interval=0, optimizer=kind,
                optimizer_impl=impl, dtype=dtype)
    monkeypatch.setattr(t, "_eval_and_track", lambda: 1.0)
    monkeypatch.setattr(t, "save_checkpoint", lambda: None)
    monkeypatch.setattr(runlog.RunLog, "mfu", lambda self, tps: 0.0)  # its probe is a measurement of its own
    steps = []
    real_step = t.train_step

    def counted_step() -> torch.Tensor:
        with HostReads() as reads:
            loss = real_step()
        steps.append(reads.count)
        return loss

    monkeypatch.setattr(t, "train_step", counted_step)
    with HostReads() as reads:
        assert t.run() == 0
    assert t.step == 20 and len(steps) == 20
    assert reads.count <= most, f"{reads.count / 20} host reads per step"
    assert sum(steps) == (20 if impl == "torch" and kind == "muon" else 0)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len([r for r in rows if "train_loss" in r]) == 2


def test_evaluation_reads_the_device_once(data: Path) -> None:
    """The evaluation's losses stay on the device, summed there, and are read once at the end (it read each
    forward's loss before: `float(loss)` per batch of windows). The model checks no ids here, so that what is
    counted is evaluate_loss's own reads."""
    from gptlab.evaluation.loss import evaluate_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=70))

    class Unchecked(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, **kwargs) -> tuple:
            return model(x, y, check_ids=False, **kwargs)

    val = TokenSplit.load(data, "val").tokens[:16 * 20 + 7]  # 20 full windows and a shorter one: 7 forwards of 3
    with HostReads() as reads:
        result = evaluate_loss(Unchecked(), val, 16, batch_size=3)
    assert reads.count == 1 and result.tokens == 16 * 20 + 6
    assert result.loss == pytest.approx(evaluate_loss(model, val, 16, batch_size=1000).loss, rel=1e-6)


def test_the_forward_reads_no_value_when_the_ids_are_checked_already() -> None:
    """`check_ids=False` (the trainer's batches are checked on the host): a forward and backward over fake
    tensors, which have no values to read, runs through. The default check reads the ids on the CPU, and on a
    CUDA tensor queues an assertion on the device instead."""
    from gptlab.ops import assert_in_range_on_device

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=50))
    with FakeTensorMode(allow_non_fake_inputs=True):
        idx = torch.empty(2, 16, dtype=torch.long)
        _, loss = model(idx, idx, reduction="sum", check_ids=False)
        loss.backward()
        with pytest.raises(Exception, match="_local_scalar_dense"):  # DataDependentOutputException
            model(idx, idx)
    with FakeTensorMode():  # fake CUDA tensors exist on a CPU-only build
        on_gpu = torch.empty(2, 16, dtype=torch.long, device="cuda")
        assert assert_in_range_on_device(on_gpu, 0, 50, "out of range")
    assert not assert_in_range_on_device(torch.zeros(2, 3, dtype=torch.long), 0, 50, "out of range")
    with pytest.raises(ValueError, match=r"token id 50 is outside \[0, 50\)"):
        model(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="target 77 is outside the vocabulary"):
        model(torch.tensor([[1, 2]]), torch.tensor([[1, 77]]))


# --- a non-finite loss ------------------------------------------------------------------------------------------
def _state(t: Trainer) -> list[torch.Tensor]:
    """The weights and every optimizer state tensor, in order."""
    out = [p.detach().clone() for p in t.model.parameters()]
    for opt in t.optimizers:
        for state in opt.state_dict()["state"].values():
            out += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize(
    ("kind", "impl", "dtype", "checkpoint_interval"),
    [("adamw", "torch", "float32", 0), ("adamw", "gptlab", "float32", 4), ("muon", "gptlab", "bfloat16", 0),
     ("muon", "torch", "float32", 4)],
)
def test_a_non_finite_loss_never_steps_and_stops_the_run_at_the_next_read(
    tmp_path: Path, data: Path, kind: str, impl: str, dtype: str, checkpoint_interval: int
) -> None:
    """The loss of step 4 (1-based) is NaN; nobody reads it then. Neither that step nor the one after changes a
    weight or the optimizer state (decided on the device), and the run stops at the next read (the checkpoint
    of step 4, or the log row of step 5) with the message the trainer always gave, naming step 4, and no row or
    checkpoint of the steps past it."""
    recipe = dict(max_steps=20, log_interval=5, checkpoint_interval=checkpoint_interval, optimizer=kind,
                  optimizer_impl=impl, dtype=dtype)
    ref = trainer(tmp_path, data, "ref", **recipe)
    for _ in range(3):
        set_lr(ref.optimizers, ref._lr_multiplier())
        ref.train_step()
    ref.release()

    bad = trainer(tmp_path, data, "bad", **recipe)
    net = bad.net

    def nan_at_step_3(x: torch.Tensor, y: torch.Tensor, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        logits, loss = net(x, y, **kw)
        return logits, loss * (math.nan if bad.step == 3 else 1.0)

    bad.net = nan_at_step_3
    with pytest.raises(GptlabError, match=r"loss is nan at step 4; stopped without updating the weights \(no "
                                          r"checkpoint was written yet\)"):
        bad.run()
    assert bad.step == 3
    assert all(torch.equal(a, b) for a, b in zip(_state(bad), _state(ref), strict=True))
    assert not list_step_checkpoints(tmp_path / "bad")
    assert (tmp_path / "bad" / "metrics.jsonl").read_text() == ""


def _optimizers(kind: str, params: list[torch.nn.Parameter]) -> list:
    if kind == "fused":
        return [FusedAdamW(params, lr=0.1, weight_decay=0.1)]
    if kind == "torch-fused":
        return [torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)]
    if kind == "batched-muon":
        return [BatchedMuon(params, lr=0.1, weight_decay=0.1)]
    if kind == "batched-muon-no-decay":  # a skipped step is a zero update instead of a select per matrix
        return [BatchedMuon(params, lr=0.1)]
    return [torch.optim.Muon(params, lr=0.1, weight_decay=0.1, adjust_lr_fn="original")]


@pytest.mark.parametrize("kind", ["fused", "torch-fused", "batched-muon", "batched-muon-no-decay", "torch-muon"])
def test_a_skipped_step_changes_nothing_and_a_finite_one_is_exact(kind: str) -> None:
    """`step_optimizers(..., skip)`: with skip false, bit for bit the plain step; with skip true (and NaN
    gradients), no weight and no optimizer state moves."""
    torch.manual_seed(0)
    start = [torch.randn(8, 16), torch.randn(24, 8)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(4)]

    def run(skips: list[bool | None]) -> tuple[list[torch.Tensor], dict]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizers = _optimizers(kind, params)
        for i, skip in enumerate(skips):
            for p, g in zip(params, grads[i], strict=True):
                p.grad = g * math.nan if skip else g.clone()
            step_optimizers(optimizers, None if skip is None else torch.tensor(skip))
        return [p.detach() for p in params], optimizers[0].state_dict()["state"]

    plain, plain_state = run([None, None, None])
    flagged, flagged_state = run([False, False, False])
    assert all(torch.equal(a, b) for a, b in zip(plain, flagged, strict=True))
    for i, state in plain_state.items():
        assert all(torch.equal(v, flagged_state[i][k]) for k, v in state.items() if isinstance(v, torch.Tensor))
    two, two_state = run([False, False])
    skipped, skipped_state = run([False, False, True, True])
    assert all(torch.equal(a, b) for a, b in zip(two, skipped, strict=True))
    for i, state in two_state.items():
        assert all(torch.equal(v, skipped_state[i][k]) for k, v in state.items() if isinstance(v, torch.Tensor))


def test_fp16_loss_scaling_skips_a_flagged_step_through_gradscaler() -> None:
    """Under fp16 GradScaler decides on the device whether gradients are finite: a flagged step gets a NaN
    gradient, so GradScaler skips it; an unflagged one is exactly the step without the flag."""
    def run(skip: bool | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=50))
        precision = Precision(model, "float16", "cpu", attention_fp32=True, distributed=False)
        optimizers = [FusedAdamW(model.parameters(), lr=1e-2)]
        rows = torch.from_numpy(np.random.default_rng(0).integers(0, 50, (4, 17)))
        with precision.autocast():
            _, loss = precision.train_module(rows[:, :-1], rows[:, 1:])
        precision.backward(loss)
        precision.step(optimizers, grad_clip=1.0, skip=None if skip is None else torch.tensor(skip))
        return [p.detach() for p in model.parameters()]

    torch.manual_seed(0)
    start = [p.detach() for p in GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16,
                                                      vocab_size=50)).parameters()]
    plain, unflagged, flagged = run(None), run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, unflagged, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(plain, start, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(flagged, start, strict=True))


# --- batches prepared ahead -------------------------------------------------------------------------------------
def test_the_feed_prepares_each_steps_batches_ahead_and_checks_their_ids(tmp_path: Path, data: Path) -> None:
    split = TokenSplit.load(data, "train")
    feed = StepFeed(split, seed=3, batch_size=8, seq_len=16, rank=1, world=2, grad_accum=2, vocab_size=200,
                    device="cpu")
    feed.prefetch(5)
    for step in (5, 6):  # prepared ahead, then made on demand: the same batches as step_batch's
        got, want = feed.get(step), step_batch(split, 3, step, 8, 16)
        assert got.step == step and got.n_targets == want.n_targets == 8 * 16
        for m, (x, y) in enumerate(got.micro):
            wx, wy = want.micro(1, 2, m, 2)
            assert torch.equal(x, wx) and torch.equal(y, wy)
    feed.prefetch(7)
    assert feed.get(9).step == 9  # a prefetch of another step is not used
    small = StepFeed(split, seed=3, batch_size=8, seq_len=16, rank=0, world=1, grad_accum=1, vocab_size=3,
                     device="cpu")
    with pytest.raises(GptlabError, match=r"token id \d+ is outside \[0, 3\) \(the model's vocab_size\)"):
        small.get(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_feed_copies_from_pinned_memory_without_waiting(data: Path) -> None:
    split = TokenSplit.load(data, "train")
    feed = StepFeed(split, seed=3, batch_size=8, seq_len=16, rank=0, world=1, grad_accum=1, vocab_size=200,
                    device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        feed.prefetch(0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    (x, y), = feed.get(0).micro
    wx, wy = step_batch(split, 3, 0, 8, 16).micro(0, 1, 0, 1)
    assert x.is_cuda and torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)


# --- a stop signal under torchrun ---------------------------------------------------------------------------------
def _rank_pids(parent: str, timeout: float = 60.0) -> dict[int, int]:
    """The torchrun workers under `parent`, by RANK (read from /proc)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = {}
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"GPTLAB_TEST_PARENT={parent}".encode() in env and b"gptlab.cli" in cmdline:
                rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
                if rank is not None:
                    found[rank] = pid
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("torchrun's workers did not start")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_signal_to_one_torchrun_process_stops_every_one_at_the_same_step(tmp_path: Path, data: Path) -> None:
    """Only rank 1 gets SIGTERM: the flag all-reduced with the loss (read a step late, so no process waits for
    it) stops both after the same step; rank 0 writes the checkpoint and says how to resume."""
    recipe = write_recipe(tmp_path, max_steps=1_000_000, eval_interval=0, log_interval=5)
    run = tmp_path / "run"
    marker = str(os.getpid()) + "-" + tmp_path.name
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPTLAB_TEST_PARENT": marker}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptlab.cli",
           "train", str(recipe), "--data", str(data), "--out", str(run)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = _rank_pids(marker)
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size > 0):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    (ckpt,) = list_step_checkpoints(run)
    step = int(ckpt.name.split("-")[1])
    assert f"stopped by SIGTERM at step {step}" in err
    assert "resume with: torchrun --standalone --nproc-per-node 2 -m gptlab.cli train " in err  # not 1 process
