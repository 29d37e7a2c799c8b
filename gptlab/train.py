"""`gptlab train CONFIG.toml --data DATA_DIR --out RUN_DIR [--resume] [--key value ...]`: the training loop.

One optimizer step, in order: for each of `grad_accum` micro-steps take this process's slice of the global
batch, forward, backward (loss / grad_accum); move gradients to the fp32 master weights; clip the global norm;
step; copy the masters back to the working weights. Evaluate, log and checkpoint between steps.

Reproducibility: the global batch of step s is a pure function of (seed, s), so a resumed run, or one split
over more processes or micro-steps, sees the same data. With fp32 and no compile, a run killed after a
checkpoint and resumed ends with bit-identical weights (the torch RNG, used by dropout, is saved too).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab import checkpoint as ckpt
from gptlab.errors import GptlabError
from gptlab.optim import build_optimizers, lr_multiplier, set_lr
from gptlab.precision import Precision
from gptlab.runlog import METRICS_FILE, RunLog
from gptlab.trainer_config import RESUMABLE_CHANGES, TrainConfig, load_train_config

RESOLVED_CONFIG = "config.resolved.json"


# ------------------------------------------------------------------------------------------------------------
# Data: random windows, a pure function of (seed, step)
# ------------------------------------------------------------------------------------------------------------
def global_batch(data: np.ndarray, seed: int, step: int, batch_size: int, block_size: int) -> torch.Tensor:
    """The (batch_size, block_size + 1) token windows of optimizer step `step`: inputs are [:, :-1], targets
    [:, 1:].

    Offsets come from a generator seeded with (seed, step), so no RNG state needs saving and every process can
    cut its own rows out of the same global batch.
    """
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    windows = data[starts[:, None] + np.arange(block_size + 1)]
    return torch.from_numpy(windows.astype(np.int64))


def micro_batch(windows: torch.Tensor, rank: int, world: int, micro: int, grad_accum: int) -> torch.Tensor:
    """Rows of the global batch for process `rank`, micro-step `micro`: contiguous slices, rank-major."""
    per_micro = windows.shape[0] // (world * grad_accum)
    start = (rank * grad_accum + micro) * per_micro
    return windows[start : start + per_micro]


# ------------------------------------------------------------------------------------------------------------
# Distributed set-up (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK)
# ------------------------------------------------------------------------------------------------------------
def shard_model(model: torch.nn.Module) -> None:
    """FSDP (PyTorch's fully_shard), in place: each block's parameters, then the rest (embeddings, final norm,
    head), become shards of this process; forward and backward gather each block's weights when it runs."""
    from torch.distributed.fsdp import fully_shard

    for block in model.iter_blocks():
        fully_shard(block)
    fully_shard(model)


def init_distributed(device: str) -> tuple[int, int, str]:
    """(rank, world_size, device); initializes the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return rank, world, device


def resolve_device(cfg: TrainConfig) -> str:
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GptlabError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if cfg.dtype == "float16" and device == "cpu":
        raise GptlabError("dtype float16 is not supported for training on the CPU; use bfloat16 or float32")
    if cfg.dtype == "bfloat16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise GptlabError("this GPU has no bfloat16 support; use --dtype float16 (loss scaling) or float32")
    return device


# ------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: TrainConfig, data_dir: Path, run_dir: Path, resume: bool, quiet: bool) -> None:
        from gptlab.data import check_split_fits, load_split, read_meta

        self.cfg, self.data_dir, self.run_dir, self.quiet = cfg, data_dir, run_dir, quiet
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = resolve_device(cfg)
        self.rank, self.world, self.device = init_distributed(device)
        self.master = self.rank == 0
        if cfg.batch_size % (self.world * cfg.grad_accum):
            raise GptlabError(
                f"batch_size {cfg.batch_size} does not split over {self.world} process(es) x "
                f"grad_accum {cfg.grad_accum}"
            )

        # --- run directory: fresh, or resumed from its latest checkpoint
        steps = ckpt.list_step_checkpoints(run_dir)
        if steps and not resume:
            raise GptlabError(
                f"{run_dir} already holds checkpoints: pass --resume to continue it, or choose another --out"
            )
        self.resume_from = steps[-1] if resume and steps else None

        # --- data and model
        meta = read_meta(data_dir)
        if not cfg.init_from:  # fail on the data before allocating the model
            for split in ("train", "val"):
                check_split_fits(data_dir, split, cfg.model_config().block_size)
        self.model = self._build_model(int(meta["vocab_size"]))
        block = self.model.config.block_size
        for split in ("train", "val"):
            check_split_fits(data_dir, split, block)
        self.train_data = load_split(data_dir, "train")
        self.val_data = load_split(data_dir, "val")
        self.tokens_per_step = cfg.batch_size * block

        self.fsdp = cfg.distributed == "fsdp" and self.world > 1  # one process has nothing to shard
        if cfg.distributed == "fsdp" and self.world == 1 and not quiet:
            print("note: distributed = fsdp shards over torchrun's processes; one process trains unsharded",
                  file=sys.stderr)
        self.precision = Precision(self.model, cfg.dtype, self.device, cfg.attention_fp32, self.world > 1 or self.fsdp)
        if self.fsdp:  # in place, before the optimizers see the parameters: they become this process's shards
            shard_model(self.model)
        self.optimizers = build_optimizers(self.model, cfg)
        self.step, self.elapsed, self.best_val = 0, 0.0, math.inf
        if self.resume_from is not None:
            self._load(self.resume_from)
        self.net = self.precision.train_module  # what forward/backward run on: maybe wrapped below
        if self.world > 1 and not self.fsdp:
            self.net = self._wrap_distributed(self.net)
        if cfg.compile:
            self.net = torch.compile(self.net)
        self.stop_signal: int | None = None

    def _build_model(self, vocab_size: int) -> torch.nn.Module:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # the same init on every process
        if cfg.init_from:
            model, _ = ckpt.load_model(cfg.init_from, device=self.device, prefer="best")
            # the architecture comes from the checkpoint: recipe keys may only restate it (or set dropout)
            clash = {k: v for k, v in cfg.model_overrides.items()
                     if k != "dropout" and getattr(model.config, k) != v}
            if clash:
                key = sorted(clash)[0]
                raise GptlabError(f"init_from {cfg.init_from} has {key}={getattr(model.config, key)!r}, the recipe "
                                  f"says {clash[key]!r}: with init_from only dropout may change")
            if "dropout" in cfg.model_overrides:
                model.config.dropout = cfg.model_overrides["dropout"]
                for m in model.modules():
                    if isinstance(m, torch.nn.Dropout):
                        m.p = model.config.dropout
            if model.config.vocab_size < vocab_size:
                raise GptlabError(
                    f"{cfg.init_from} has a vocabulary of {model.config.vocab_size}, the data needs "
                    f"{vocab_size}"
                )
            model.float()
        else:
            from gptlab.model import GPT

            with torch.device(self.device):
                model = GPT(cfg.model_config(vocab_size))
        return model.train()

    def _wrap_distributed(self, net: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(net, device_ids=[self.device] if self.device.startswith("cuda") else None)

    # --- checkpoints ----------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        rng = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
        if torch.cuda.is_available():
            rng["cuda"] = [
                base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
            ]
        return {
            "step": self.step,
            "elapsed_sec": self.elapsed,
            "best_val_loss": self._finite(self.best_val),
            "tokens_seen": self.step * self.tokens_per_step,
            "rng": rng,
            "config_hash": self.cfg.hash(RESUMABLE_CHANGES),
            "config": self.cfg.to_dict(),
            "data_dir": str(self.data_dir),
        }

    @staticmethod
    def _finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    def _load(self, directory: Path) -> None:
        state = ckpt.load_training_checkpoint(directory, self.model, self.optimizers)
        if state["config_hash"] != self.cfg.hash(RESUMABLE_CHANGES):
            saved, now = state["config"], self.cfg.to_dict()
            diff = [k for k in now if k not in RESUMABLE_CHANGES and saved.get(k) != now[k]]
            shown = ", ".join(f"{k} ({saved.get(k)!r} -> {now[k]!r})" for k in diff[:4])
            raise GptlabError(
                f"cannot resume {directory}: the config differs in {shown}; only "
                f"{', '.join(sorted(RESUMABLE_CHANGES))} may change"
            )
        self.step, self.elapsed = state["step"], state["elapsed_sec"]
        self.best_val = state["best_val_loss"] if state["best_val_loss"] is not None else math.inf
        torch.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(state["rng"]["torch"])), dtype=torch.uint8)
        )
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [
                    torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                    for s in state["rng"]["cuda"]
                ]
            )
        self.precision.sync_weights()

    def save_checkpoint(self) -> Path | None:
        if not self.master and not self.fsdp:  # under FSDP every process takes part in gathering the shards
            return None
        path = self.run_dir / ckpt.CHECKPOINTS_DIR / ckpt.step_dir_name(self.step)
        if ckpt.save_training_checkpoint(
            path, self.model, self.optimizers, self._state(), self.data_dir, writer=self.master
        ) is None:
            return None
        ckpt.prune_checkpoints(self.run_dir, self.cfg.keep_last)
        return path

    def save_best(self) -> None:
        if not self.master and not self.fsdp:
            return
        weights = ckpt.model_state_dict(self.model)  # FSDP: gathered by every process
        if not self.master:
            return
        state = {"step": self.step, "val_loss": self.best_val}

        def write(tmp: Path) -> None:
            ckpt.write_model(tmp, self.model, weights=weights)
            (tmp / ckpt.STATE_FILE).write_text(json.dumps(state) + "\n")
            for name in ckpt.TOKENIZER_FILES:
                if (self.data_dir / name).is_file():
                    (tmp / name).write_bytes((self.data_dir / name).read_bytes())

        ckpt.atomic_write_dir(self.run_dir / ckpt.CHECKPOINTS_DIR / ckpt.BEST_NAME, write)

    # --- evaluation -----------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        from gptlab.evaluate import evaluate_loss

        result = evaluate_loss(
            self.precision.eval_module,
            self.val_data,
            self.model.config.block_size,
            batch_size=self.cfg.eval_batch_size,
            max_tokens=self.cfg.eval_tokens,
            device=self.device,
            autocast=self.precision.autocast(),
        )
        return result.loss

    # --- the loop -------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step; returns the mean loss over the whole global batch."""
        cfg = self.cfg
        windows = global_batch(
            self.train_data, cfg.seed, self.step, cfg.batch_size, self.model.config.block_size
        )
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(cfg.grad_accum):
            rows = micro_batch(windows, self.rank, self.world, micro, cfg.grad_accum).to(self.device)
            last = micro == cfg.grad_accum - 1
            with self.precision.autocast(), self._no_sync(not last):
                _, loss = self.net(rows[:, :-1], rows[:, 1:])
                loss = loss / cfg.grad_accum
            self.precision.backward(loss)
            loss_sum += loss.detach()
        loss_value, self.stop_signal = self._agree(loss_sum, self.stop_signal)
        if not math.isfinite(loss_value):
            return loss_value  # the caller stops before any weight changes
        self.precision.step(self.optimizers, cfg.grad_clip)
        self.step += 1
        return loss_value

    def _no_sync(self, skip: bool):  # noqa: ANN202 - a context manager
        import contextlib

        if skip and hasattr(self.net, "no_sync"):
            return self.net.no_sync()  # DDP: all-reduce gradients on the last micro-step only
        if self.fsdp:  # FSDP: reduce-scatter gradients on the last micro-step only
            self.model.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()

    def _agree(self, loss_sum: torch.Tensor, stop: int | None) -> tuple[float, int | None]:
        """Mean loss over processes, and whether any process got a stop signal (all stop at the same step)."""
        if self.world == 1:
            return float(loss_sum), stop
        import torch.distributed as dist

        t = torch.stack([loss_sum.float(), torch.tensor(1.0 if stop else 0.0, device=self.device)])
        dist.all_reduce(t)
        if t[1] > 0 and stop is None:  # another process got the signal (torchrun forwards it to all)
            stop = signal.SIGTERM
        return float(t[0]) / self.world, stop

    def _from_rank0(self, value: float) -> float:
        """Rank 0's value on every process, for decisions all must take alike (stop now? save a best?)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=0)
        return float(t[0])

    def _agree_elapsed(self, elapsed: float) -> float:
        """Under a time budget every process must stop at the same step: all take rank 0's clock."""
        return elapsed if self.cfg.max_time is None else self._from_rank0(elapsed)

    def run(self) -> int:
        cfg = self.cfg
        if self.master:
            self._prepare_run_dir()
        log = RunLog(self, enabled=self.master)
        progress_bar = self._progress_bar() if self.master else None
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        last_eval_step = -1
        try:
            window_t0, window_step = time.perf_counter(), self.step
            while self.step < cfg.max_steps and not self._time_up():
                t0 = time.perf_counter()
                progress = self.step / cfg.max_steps
                if cfg.max_time is not None:  # time budgets: the schedule follows the clock (incl. this step)
                    progress = max(progress, (self.elapsed + self._step_time_estimate()) / cfg.max_time)
                lr = set_lr(self.optimizers, lr_multiplier(cfg, self.step, progress))
                loss = self.train_step()
                if not math.isfinite(loss):
                    return self._non_finite(loss)
                self._last_step_time = time.perf_counter() - t0
                self.elapsed = self._agree_elapsed(self.elapsed + self._last_step_time)
                if progress_bar is not None:
                    progress_bar.update(1)
                    progress_bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                do_eval = (
                    cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.max_steps
                )
                if self.step % cfg.log_interval == 0 or do_eval:
                    now = time.perf_counter()
                    tps = (self.step - window_step) * self.tokens_per_step / max(now - window_t0, 1e-9)
                    row = {
                        "step": self.step,
                        "train_loss": loss,
                        "lr": lr,
                        "tokens_per_sec": tps,
                        "elapsed_sec": self.elapsed,
                        "mfu": log.mfu(tps),
                    }
                    if do_eval:
                        t_eval = time.perf_counter()
                        row["val_loss"] = self._eval_and_track()
                        self.elapsed += time.perf_counter() - t_eval
                        last_eval_step = self.step
                    log.write(row)
                    if progress_bar is not None:
                        progress_bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=True)
                    window_t0, window_step = time.perf_counter(), self.step
                if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                    self.save_checkpoint()
                if self.stop_signal is not None:
                    return self._stop_on_signal(progress_bar)
            # the end: a final evaluation and checkpoint
            if progress_bar is not None:
                progress_bar.close()
            if last_eval_step != self.step:
                val = self._eval_and_track()
                log.write({"step": self.step, "val_loss": val, "elapsed_sec": self.elapsed})
            path = self.save_checkpoint()
            log.say(
                f"done: step {self.step}, val loss {self.best_val:.4f} (best), {self.elapsed:.1f}s of "
                f"training; checkpoint {path}"
            )
            return 0
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            log.close()
            if self.world > 1:
                import torch.distributed as dist

                if sys.exc_info()[1] is None:  # leave together: a rank that exits while a peer still writes
                    dist.barrier()  # the checkpoint can abort in gloo's teardown ("terminate called ...")
                dist.destroy_process_group()

    _last_step_time = 0.0

    def _step_time_estimate(self) -> float:
        return self._last_step_time

    def _time_up(self) -> bool:
        return self.cfg.max_time is not None and self.elapsed >= self.cfg.max_time

    def _eval_and_track(self) -> float:
        val = self._from_rank0(self.evaluate())  # under FSDP saving a best is collective: decide it together
        if val < self.best_val:
            self.best_val = val
            self.save_best()
        if not self.quiet and self.master:
            print(f"step {self.step}: val loss {val:.4f}", file=sys.stderr)
        return val

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is not None and signum == signal.SIGINT:  # a second Ctrl-C: stop right now
            raise KeyboardInterrupt
        self.stop_signal = signum

    def _stop_on_signal(self, progress_bar: Any) -> int:
        if progress_bar is not None:
            progress_bar.close()
        path = self.save_checkpoint()
        if self.master:
            name = signal.Signals(self.stop_signal).name
            print(
                f"stopped by {name} at step {self.step}; checkpoint {path}\n"
                f"resume with: {self.resume_command()}",
                file=sys.stderr,
            )
        return 0

    def _non_finite(self, loss: float) -> int:
        last = ckpt.list_step_checkpoints(self.run_dir)
        where = f"last good checkpoint: {last[-1]}" if last else "no checkpoint was written yet"
        raise GptlabError(
            f"loss is {loss} at step {self.step + 1}; stopped without updating the weights ({where}). "
            "Try a lower lr, grad_clip, or float32"
        )

    def resume_command(self) -> str:
        argv = [a for a in sys.argv[1:] if a != "--resume"]
        return " ".join(["gptlab", *argv, "--resume"])

    def _prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resolved = {
            "train": self.cfg.to_dict(),
            "model": self.model.config.to_dict(),
            "data": str(self.data_dir),
            "world_size": self.world,
            "device": self.device,
        }
        ckpt.atomic_write_text(self.run_dir / RESOLVED_CONFIG, json.dumps(resolved, indent=1) + "\n")
        metrics = self.run_dir / METRICS_FILE
        if metrics.exists():  # a resumed run: drop rows past the checkpoint, they will be recomputed
            rows = [
                line
                for line in metrics.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= self.step
            ]
            ckpt.atomic_write_text(metrics, "".join(r + "\n" for r in rows))

    def _progress_bar(self) -> Any:
        if self.quiet or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.max_steps, initial=self.step, unit="step", dynamic_ncols=True)


def run_train(args: argparse.Namespace) -> int:
    """`gptlab train` entry point (arguments in gptlab/cli.py)."""
    cfg = load_train_config(args.config, getattr(args, "extra", []))
    data_dir = Path(args.data)
    if not data_dir.is_dir():
        raise GptlabError(
            f"data directory {data_dir} does not exist; run `gptlab prepare ... --out {data_dir}` first"
        )
    trainer = Trainer(cfg, data_dir, Path(args.out), resume=args.resume, quiet=args.quiet)
    return trainer.run()
