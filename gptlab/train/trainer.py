"""The training loop of `gptlab train`: a recipe, a data directory and a run directory in, checkpoints out.

One optimizer step, in order: for each of `grad_accum` micro-steps take this process's slice of the global
batch, forward, backward (loss / grad_accum); move gradients to the fp32 master weights; clip the global norm;
step; copy the masters back to the working weights. Evaluate, log and checkpoint between steps.

Reproducibility: the global batch of step s is a pure function of (seed, s) (`gptlab.data.global_batch`), so a
resumed run, or one split over more processes or micro-steps, sees the same data. With fp32 and no compile, a
run killed after a checkpoint and resumed ends with bit-identical weights (the torch RNG, used by dropout, is
saved too).

The parts live beside this file: `config` (the recipe), `optim` (optimizers and schedule), `precision` (fp32,
autocast or bf16 working weights), `distributed` (torchrun processes, DDP, FSDP) and `runlog` (metrics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gptlab import causal_attention
from gptlab import checkpoint as ckpt
from gptlab.data import check_split_fits, read_meta
from gptlab.errors import GptlabError
from gptlab.evaluation.loss import evaluate_loss
from gptlab.fileio import check_out_dir
from gptlab.flops import flops_per_token
from gptlab.hardware import resolve_device, set_threads
from gptlab.tokenizer import optional_tokenizer
from gptlab.train.autotune import resolve_auto_switches
from gptlab.train.batches import StepFeed, TokenSplit, document_eot, load_train_data, pair_rows, sequence_length
from gptlab.train.benchmarks import Benchmarks, LmEvalScorer
from gptlab.train.config import TrainConfig, micro_steps, resolve_device_switches, resolve_disable_dropout
from gptlab.train.distributed import gradient_sync, init_distributed, wrap_ddp
from gptlab.train.losses import DeviceLosses
from gptlab.train.memory import check_step_memory
from gptlab.train.objectives import Preference, build_objective, check_objective_data
from gptlab.train.optim import build_optimizers, lr_schedule, optimizer_spec, set_lr
from gptlab.train.precision import Precision
from gptlab.train.rng import seed_dropout
from gptlab.train.run_checkpoints import load_run_checkpoint, save_best_weights, save_step_checkpoint
from gptlab.train.rundir import (
    RunLock,
    checkpoint_to_resume,
    prepare_run_dir,
)
from gptlab.train.runlog import RunLog, progress_bar
from gptlab.train.setup import build_model, check_dtype, shard, trained_weights
from gptlab.train.stopping import StopRequest
from gptlab.train.trackers import check_trackers, open_trackers


class Trainer:
    """One run: `Trainer(cfg, data_dir, run_dir).run()` trains into `run_dir`, or continues its latest checkpoint
    with `resume=True`. `resume_command` is the command line printed for continuing after a stop signal;
    `lm_eval_tasks` scores the recipe's lm-eval eval_tasks (`gptlab.train.benchmarks`)."""

    def __init__(
        self,
        cfg: TrainConfig,
        data_dir: str | Path,
        run_dir: str | Path,
        *,
        resume: bool = False,
        quiet: bool = False,
        resume_command: str | None = None,
        mixture: list[tuple[Path, float]] | None = None,
        lm_eval_tasks: LmEvalScorer | None = None,
    ) -> None:
        self.cfg, self.data_dir, self.run_dir = cfg, Path(data_dir), Path(run_dir)
        self.sources = mixture or [(self.data_dir, 1.0)]  # train rows from these, by weight; val from data_dir
        self.quiet, self.resume_command = quiet, resume_command
        if cfg.threads:
            set_threads(cfg.threads)
        self.procs = init_distributed(resolve_device(cfg.device, flag="device"), cfg.distributed_timeout)
        self.device, self.lock = self.procs.device, None
        try:
            # a check that fails on one process only (its files, its GPU's free memory) stops every process, each
            # with a one-line error, before the first collective: else the others would wait for it until a timeout
            with self.procs.peers_lost_as_errors():
                with self.procs.all_or_none("the checks before training"):
                    resume_from = self._setup(resume, lm_eval_tasks)
                self._setup_steps(resume_from)
        except BaseException:
            self.release()
            raise

    def _setup(self, resume: bool, lm_eval_tasks: LmEvalScorer | None) -> Path | None:
        """The checks, the model and the data: work of this process alone (no collective)."""
        cfg, quiet, device = self.cfg, self.quiet, self.device
        # --- run directory: ours alone (a lock), fresh or resumed from its latest checkpoint
        self.lock = RunLock(check_out_dir(self.run_dir), quiet) if self.procs.is_master else None
        steps = ckpt.list_step_checkpoints(self.run_dir)
        if steps and not resume:
            raise GptlabError(f"{self.run_dir} already holds checkpoints: pass --resume to continue it, or choose "
                              "another --out")
        resume_from = checkpoint_to_resume(self.run_dir) if resume else None

        # --- how it runs: "auto" switches decided (by timing this run's step on a CPU), the micro-steps
        meta = read_meta(self.data_dir)
        saved = ckpt.read_training_state(resume_from, {"config": dict})["config"] if resume_from else None
        cfg = resolve_disable_dropout(cfg, saved)  # a resumed run keeps its dropout (on, if it predates the key)
        cfg = self.cfg = resolve_auto_switches(cfg, device, self.procs.world, saved, self._probe_run,
                                               {"vocab_size": meta.get("vocab_size")}, quiet)
        check_dtype(cfg.dtype, device)
        # the micro-steps on this many processes (with micro_batch_size: the recipe's global batch on any number)
        cfg = self.cfg = dataclasses.replace(cfg, grad_accum=micro_steps(cfg, self.procs.world))
        check_trackers(cfg)

        # --- data and model
        check_objective_data(cfg.objective, meta, self.data_dir)
        optional_tokenizer(self.data_dir)  # damaged tokenizer files fail now, not in each checkpoint they go into
        if not cfg.init_from:  # fail on the data before allocating the model
            for split in ("train", "val"):
                check_split_fits(self.data_dir, split,
                                 sequence_length(self.data_dir, cfg.model_config().block_size))
            check_step_memory(cfg, cfg.model_config(int(meta["vocab_size"])), self.procs.world, self.device,
                              quiet=quiet or not self.procs.is_master, processes_here=self.procs.local_world)
        self.fsdp = cfg.distributed == "fsdp" and self.procs.world > 1  # one process has nothing to shard
        self.benchmarks = Benchmarks(cfg, self.data_dir, lm_eval_tasks, self.fsdp) if cfg.eval_tasks else None
        self.model = build_model(cfg, int(meta["vocab_size"]), self.device, self.data_dir, sharded=self.fsdp)
        self.train_data, self.seq_len = load_train_data(self.sources, self.model.config.block_size)
        # attention's dtype follows the model's head size (init_from's model, not the recipe's preset) and whether
        # gptlab's bf16 attention backward serves those heads at the rows' length here
        model_cfg, device_type = self.model.config, torch.device(device).type
        narrow_bf16 = (device_type == "cpu" and cfg.dtype == "bfloat16" and cfg.attention_fp32 == "auto"
                       and causal_attention.serves(model_cfg.head_size, self.seq_len))
        cfg = self.cfg = resolve_device_switches(cfg, device_type, model_cfg.head_size, saved, narrow_bf16)
        seed_dropout(cfg.seed, self.procs)  # the same init on every process, then a dropout stream for each
        if cfg.init_from:
            check_step_memory(cfg, self.model.config, self.procs.world, self.device, fresh=False,
                              quiet=quiet or not self.procs.is_master, processes_here=self.procs.local_world)
        check_split_fits(self.data_dir, "val", self.seq_len)
        self.val_data = TokenSplit.load(self.data_dir, "val")
        self.feed = StepFeed(self.train_data, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=self.seq_len,
                             rank=self.procs.rank, world=self.procs.world, grad_accum=cfg.grad_accum,
                             vocab_size=self.model.config.vocab_size, device=self.device,
                             document_eot=document_eot(cfg.document_mask, self.sources),
                             count_tokens=cfg.objective != "grpo")  # GRPO's rows are its rollouts: counted below
        self.losses = DeviceLosses(self.procs.world)
        return resume_from

    @contextlib.contextmanager
    def _probe_run(self, cfg: TrainConfig) -> Iterator[Trainer]:
        """A run of `cfg` on this run's data in a scratch directory, for `autotune` to time its steps."""
        with tempfile.TemporaryDirectory(prefix="gptlab-probe-") as scratch:
            probe = Trainer(cfg, self.data_dir, Path(scratch) / "run", quiet=True, mixture=self.sources)
            try:
                yield probe
            finally:
                probe.release()

    def _setup_steps(self, resume_from: Path | None) -> None:
        """How the steps run: precision, sharding, optimizers, the checkpoint, then the wrappers forward runs
        through (collectives from here on: FSDP's and DDP's)."""
        cfg, quiet = self.cfg, self.quiet
        if cfg.distributed == "fsdp" and self.procs.world == 1 and not quiet:
            print("note: distributed = fsdp shards over torchrun's processes; one process trains unsharded",
                  file=sys.stderr)
        self.precision = Precision(self.model, cfg.dtype, self.device, cfg.attention_fp32,
                                   distributed=self.procs.world > 1, sharded=self.fsdp)
        if self.fsdp:  # in place, before the optimizers see the parameters: they become this process's shards
            shard(self.model, cfg, self.device)
        self.opt_spec, self.schedule = optimizer_spec(cfg), lr_schedule(cfg)
        # DDP replicas split Muon's Newton-Schulz between them; FSDP's shards are no whole matrices (no Muon there)
        self.optimizers = build_optimizers(self.model, self.opt_spec, rank=self.procs.rank,
                                           world=1 if self.fsdp else self.procs.world)
        self.step, self.elapsed, self.best_val, self.ended_at = 0, 0.0, math.inf, -1  # ended_at: `_train`'s end
        # before a checkpoint loads: a preference objective's reference is the starting weights
        self.objective = build_objective(cfg, self.precision.train_module, self.data_dir)
        self.step_stats: torch.Tensor | None = None  # the latest step's objective statistics, summed
        # elapsed_sec when warm-up ended (None before): a time budget's decay runs from there to max_time
        self.warmup_elapsed: float | None = 0.0 if cfg.warmup_steps == 0 else None
        if resume_from is not None:
            load_run_checkpoint(self, resume_from)
        self.net = self.precision.train_module  # what forward/backward run on: maybe wrapped below
        if self.procs.world > 1 and not self.fsdp:
            self.net = wrap_ddp(self.net, self.device)
        if cfg.compile:
            self.net = torch.compile(self.net)
        self.stop = StopRequest(self.procs.world)
        self._last_step_time = 0.0

    # --- checkpoints (`run_checkpoints`) --------------------------------------------------------------------
    def release(self) -> None:
        """Let go of the run directory (its lock): `run` does at its end."""
        if self.lock is not None:
            self.lock.release()

    def save_checkpoint(self, gather: bool = True) -> Path | None:
        """A resumable step checkpoint (keeping the newest `keep_last`); its path on the writing process. Every
        process calls it (each one's dropout stream is gathered), unless `gather` is False (after an error)."""
        return save_step_checkpoint(self, gather)

    def save_best(self) -> None:
        """checkpoints/best/: the weights of the best validation loss so far (no optimizer state)."""
        save_best_weights(self)

    # --- evaluation -----------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Validation loss over `eval_tokens` of the val split (all of it by default); each process scores its
        share of the windows and gets the loss over all of them."""
        val, procs = self.val_data, self.procs
        if isinstance(self.objective, Preference):  # every process scores every pair (val sets of pairs are small)
            pairs = max(1, (self.cfg.eval_batch_size or self.cfg.batch_size) // 2)
            return self.objective.evaluate(self.precision.eval_module, pair_rows(val, pairs), self.precision.autocast())
        return evaluate_loss(
            self.precision.eval_module, val.tokens, self.seq_len,
            batch_size=self.cfg.eval_batch_size, max_tokens=self.cfg.eval_tokens, device=self.device,
            autocast=self.precision.autocast(), mask=val.mask, window_tokens=val.window_tokens, rank=procs.rank,
            world=procs.world, document_eot=self.feed.document_eot,  # documents alone, as they train
        ).loss

    def _eval_and_track(self) -> float:
        # every process has the all-reduced loss; rank 0's, to be sure they decide alike (under FSDP saving a best
        # is collective)
        (val,) = self.procs.from_rank0(self.evaluate())
        if val < self.best_val:
            self.best_val = val
            self.save_best()
        if not self.quiet and self.procs.is_master:
            print(f"step {self.step}: val loss {val:.4f}", file=sys.stderr)
        return val

    # --- the loop -------------------------------------------------------------------------------------------
    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns the mean loss over the counted targets of the whole global batch, a 0-dim
        tensor on the device: nothing here waits for the device. A non-finite loss leaves the weights and the
        optimizer state alone (decided on the device), as does every step after it until `read_loss`, which
        then stops the run."""
        cfg, procs = self.cfg, self.procs
        batch = self.feed.get(self.step)
        # gradients are averaged over processes, so each process's share is scaled up by their number
        count = max(self.objective.step_count(batch.n_targets), 1)  # the step's loss is the mean over these
        scale = procs.world / count
        sums = torch.zeros(1 + len(self.objective.stats), dtype=torch.float32, device=self.device)  # loss, stats
        for micro, (x, y) in enumerate(batch.micro):
            with self.precision.autocast(), gradient_sync(self.net, self.model, micro == cfg.grad_accum - 1):
                loss, stats = self.objective.loss(self.net, x, y, scale, batch.documents[micro])
            self.precision.backward(loss)
            sums += torch.cat([loss.detach().float().reshape(1), stats])
        if self.step + 1 < cfg.max_steps:
            self.feed.prefetch(self.step + 1)  # the host's share of the next step, while the device runs this one
        made = self.objective.take_made_tokens()  # GRPO's rollout rows' tokens: summed over processes below
        sums = sums if made is None else torch.cat([sums, sums.new_tensor([made])])
        # all processes stop at the same step: a signal seen by one (torchrun forwards it to all) stops every one
        sums, any_stop = procs.sum_and_any(sums, self.stop.seen)
        if made is not None:  # a host read, where the rollouts' sampling read the device all step anyway
            self.feed.seen_tokens, sums = self.feed.seen_tokens + int(sums[-1]), sums[:-1]
        total, self.step_stats = sums[0], sums[1:] / count  # statistics: sums over all pairs (completions)
        self.precision.step(self.optimizers, cfg.grad_clip, skip=self.losses.add(self.step, total))
        self.step += 1
        self.stop.agree(any_stop)
        return total if procs.world == 1 else total / procs.world

    def read_loss(self) -> float:
        """The latest step's loss, read from the device with every loss since the last read; a non-finite one
        among them stops the run (a GptlabError naming its step, where the weights still are)."""
        loss, bad = self.losses.read()
        if bad is not None:
            self.step = bad.step  # no step from the bad one on changed the weights
            raise bad.error(ckpt.list_step_checkpoints(self.run_dir))
        return loss

    def run(self) -> int:
        """Train to max_steps (or max_time), then evaluate and checkpoint once more; returns the exit code."""
        if self.procs.is_master:
            self._prepare_run_dir()
        model_cfg = self.model.config
        try:
            trackers = (open_trackers(self.cfg, self.run_dir, self._resolved(), self.step, self.quiet)
                        if self.procs.is_master else [])
        except BaseException:  # a tracker's run that did not start: the run directory is let go all the same
            self.procs.close(False)
            self.release()
            raise
        log = RunLog(
            self.run_dir, enabled=self.procs.is_master, quiet=self.quiet, trackers=trackers,
            flops_per_token=flops_per_token(model_cfg, self.seq_len, trained=trained_weights(self.model)),
            device=self.device, world_size=self.procs.world, dtype=self.cfg.dtype,
        )
        bar = progress_bar(self.cfg.max_steps, self.step, show=not self.quiet and self.procs.is_master)
        clean = False
        try:
            # a stop signal checkpoints after the current step; a peer lost is a one-line error
            with self.stop.handling(), self.procs.peers_lost_as_errors():
                code = self._train(log, bar)
            clean = True
            return code
        finally:
            if bar is not None:
                bar.close()
            log.close()
            self.procs.close(clean)
            self.release()

    def _train(self, log: RunLog, bar: Any) -> int:
        cfg = self.cfg
        # a resumed run that had ended here (a requeued job) evaluated this step already
        last_eval_step = scored_step = self.step if self.ended_at == self.step else -1
        window_t0, window_step, window_tokens = time.perf_counter(), self.step, self.feed.seen_tokens  # since a row
        while self.step < cfg.max_steps and not self._time_up():
            t0 = time.perf_counter()
            multiplier = self._lr_multiplier()
            set_lr(self.optimizers, multiplier)
            self.train_step()
            self._last_step_time = time.perf_counter() - t0
            self.elapsed += self._last_step_time
            if bar is not None:
                bar.update(1)
            do_eval = cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.max_steps
            do_tasks = self.benchmarks is not None and self.benchmarks.due(self.step) and self.step < cfg.max_steps
            if self.step % cfg.log_interval == 0 or do_eval or do_tasks:
                loss = self.read_loss()  # the losses' only read between checkpoints: it waits for the device
                tps = (self.feed.seen_tokens - window_tokens) / max(time.perf_counter() - window_t0, 1e-9)
                row = {"step": self.step, "train_loss": loss, "lr": self.opt_spec.lr * multiplier,
                       "tokens_per_sec": tps, "tokens_seen": self.feed.seen_tokens, "elapsed_sec": self.elapsed,
                       **log.utilization(tps),
                       "loader_ms": self.feed.per_step_ms(self.step - window_step),
                       **self.objective.stats_row(self.step_stats)}
                if do_eval:
                    t_eval = time.perf_counter()
                    row["val_loss"] = self._eval_and_track()
                    self.elapsed += time.perf_counter() - t_eval
                    last_eval_step = self.step
                if do_tasks:
                    row.update(self._score_tasks())
                    scored_step = self.step
                log.write(row)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=True)
                window_t0, window_step, window_tokens = time.perf_counter(), self.step, self.feed.seen_tokens
            if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                self.read_loss()  # never a checkpoint of a step that a non-finite loss skipped
                self.save_checkpoint()
            if self.stop.due:
                self.read_loss()
                return self._stop_on_signal(bar)
            if cfg.max_time is not None:
                # under a time budget the clock sets the next step's lr and whether there is one: every process
                # takes rank 0's (each one's own, with its own evaluation time, would differ: DDP replicas drifting
                # apart, or one process stopping while another waits in the next step's collectives)
                self.elapsed, self._last_step_time = self.procs.from_rank0(self.elapsed, self._last_step_time)
        self.read_loss()  # the end: a final evaluation (unless this step just had one) and checkpoint
        if bar is not None:
            bar.close()
        final: dict[str, Any] = {"step": self.step}
        try:
            if last_eval_step != self.step:
                final["val_loss"] = self._eval_and_track()
            if scored_step != self.step:
                final.update(self._score_tasks())
        except BaseException:  # the weights of the whole run must not depend on the evaluation succeeding
            path = self.save_checkpoint(gather=False)  # the failure may be this process's alone
            log.say(f"the final evaluation failed; the weights of step {self.step} are saved in {path}")
            raise
        if len(final) > 1:
            log.write({**final, "elapsed_sec": self.elapsed, "tokens_seen": self.feed.seen_tokens})
        self.ended_at = self.step
        path = self.save_checkpoint()
        log.say(f"done: step {self.step}, val loss {self.best_val:.4f} (best), {self.elapsed:.1f}s of training; "
                f"checkpoint {path}")
        return 0

    def _lr_multiplier(self) -> float:
        """The schedule's factor for the coming step. Its decay starts where warm-up ends; under a time budget
        the clock is taken at this step's end (elapsed plus the last step's time), so the last step is at min_lr."""
        if self.warmup_elapsed is None and self.step >= self.schedule.warmup_steps:
            self.warmup_elapsed = self.elapsed
        return self.schedule.at(self.step, self.cfg.max_steps, clock=self.elapsed + self._last_step_time,
                                max_time=self.cfg.max_time, warmup_elapsed=self.warmup_elapsed)

    def _time_up(self) -> bool:
        return self.cfg.max_time is not None and self.elapsed >= self.cfg.max_time

    def _stop_on_signal(self, bar: Any) -> int:
        if bar is not None:
            bar.close()
        path = self.save_checkpoint()
        if self.procs.is_master:
            how = self.resume_command or "the same command with --resume"
            print(f"stopped by {self.stop.name} at step {self.step}; checkpoint {path}\n"
                  f"resume with: {how}", file=sys.stderr)
        return 0

    def _score_tasks(self) -> dict[str, float]:
        """The eval_tasks' scores for this step's row (the master's: the row it writes); not counted in
        elapsed_sec, so that runs with and without benchmarks compare on one clock."""
        if self.benchmarks is None or not self.procs.is_master:
            return {}
        return self.benchmarks.score(self.precision.eval_module, self.run_dir.resolve().name,
                                     self.precision.autocast())

    def _resolved(self) -> dict[str, Any]:
        """config.resolved.json: the recipe as it runs (also what the trackers record)."""
        return {"train": self.cfg.to_dict(), "model": self.model.config.to_dict(),
                "data": str(self.data_dir.absolute()),  # (`gptlab eval RUN` scores it, from any folder)
                "world_size": self.procs.world, "device": self.device}

    def _prepare_run_dir(self) -> None:
        prepare_run_dir(self.run_dir, self._resolved(), self.step, self.quiet)
