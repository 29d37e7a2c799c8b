"""Training over several processes (torchrun): joining the group, wrapping the model, deciding together.

torchrun starts one process per device and tells each its place through RANK / WORLD_SIZE / LOCAL_RANK.
Everything that needs more than one process lives here, so the trainer reads the same with one or many:

- `init_distributed` joins the process group (NCCL on GPUs, gloo on CPUs) or, alone, does nothing;
- the model is either replicated (`wrap_ddp`: gradients all-reduced) or sharded (`shard_model`: FSDP);
- `gradient_sync` skips the gradient exchange on all but the last micro-step of gradient accumulation;
- decisions that every process must take alike (stop on a signal, stop on the clock, save a new best) go
  through `Processes.sum_and_any` and `Processes.from_rank0`, or a process would wait forever in a
  collective its peers never enter; so do the checks before training (`Processes.all_or_none`): a process
  that fails one (its own files, its GPU's free memory) stops its peers too;
- a collective that fails because a peer ended or stopped answering is a one-line error saying so
  (`Processes.peers_lost_as_errors`), not gloo's or NCCL's own words as if this process had a bug;
- `Processes.close` leaves together: a rank that exits while a peer still writes a checkpoint can abort gloo's
  teardown ("terminate called ...").
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gptlab.errors import GptlabError


@dataclass(frozen=True)
class Processes:
    """This process's place in the run: rank, how many processes there are, and its device; `local_world`: how many
    of them run on this machine (torchrun's LOCAL_WORLD_SIZE)."""

    rank: int
    world: int
    device: str
    local_world: int = 1

    @property
    def is_master(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    def sum_and_any(self, value: torch.Tensor, flag: bool) -> tuple[torch.Tensor, torch.Tensor | bool]:
        """The sum of a tensor (a scalar or a vector) over all processes, and whether `flag` is set on any of
        them, both left on the device (one all-reduce, no host read); alone, `value` and `flag` themselves."""
        if self.world == 1:
            return value, flag
        import torch.distributed as dist

        t = torch.cat([value.float().reshape(-1), torch.full((1,), 1.0 if flag else 0.0, device=value.device)])
        dist.all_reduce(t)
        return t[:-1].reshape(value.shape), t[-1] > 0

    def from_rank0(self, *values: float) -> tuple[float, ...]:
        """Rank 0's values on every process (one broadcast)."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=0)
        return tuple(t.tolist())

    @contextlib.contextmanager
    def all_or_none(self, what: str) -> Iterator[None]:
        """Work of each process alone (no collective inside) that may fail on some only: if it fails on any, it
        fails on all. The failing process raises its own error, its peers a one-line one naming it; without
        this they would go on to their next collective and wait there for it until the timeout."""
        if self.world == 1:
            yield
            return
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # telling the peers is best effort: the error itself matters more
                self._failed_ranks(True)
            raise
        failed = self._failed_ranks(False)
        if failed:
            which = ", ".join(str(r) for r in failed)
            raise GptlabError(f"rank {which} of {self.world} processes failed {what} (its own error says why): every "
                              "process stops")

    def _failed_ranks(self, failed: bool) -> list[int]:
        """The ranks that say they failed (a collective: every process calls it once per `all_or_none`)."""
        import torch.distributed as dist

        flags = torch.zeros(self.world, device=self.device)
        flags[self.rank] = float(failed)
        dist.all_reduce(flags)
        return [r for r, flag in enumerate(flags.tolist()) if flag]

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (small and picklable), in rank order, on every process."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    @contextlib.contextmanager
    def peers_lost_as_errors(self) -> Iterator[None]:
        """A collective that failed because a peer ended or stopped answering (its socket closed, the timeout)
        becomes a one-line GptlabError saying so: the peer's own error says why, and this is no bug here."""
        try:
            yield
        except RuntimeError as e:
            said = _peer_lost(e) if self.world > 1 else None
            if said is None:
                raise
            raise GptlabError(f"process {self.rank} of {self.world}: another process of this run ended or stopped "
                              f"answering ({said}); this one stops too (the other's own error, if any, says why)"
                              ) from None

    def close(self, clean: bool) -> None:
        """Leave the process group; after a clean run, first wait for every peer to get here."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if clean:  # after an error a peer may never arrive: don't wait for it
            dist.barrier()
        dist.destroy_process_group()


def init_distributed(device: str, timeout: float | None = None) -> Processes:
    """Join torchrun's process group (each process takes the GPU of its LOCAL_RANK); alone, just `device`.
    `timeout`: seconds a collective waits for its peers (None: torch's default)."""
    world = _env_int("WORLD_SIZE", "1")
    if world == 1:
        return Processes(0, 1, device)
    import torch.distributed as dist

    # torchrun sets all three; a launcher that sets only RANK/WORLD_SIZE (some srun/mpirun wrappers) would put
    # every process of a node on cuda:0 (OOM or NCCL's "Duplicate GPU detected"): refuse instead of guessing
    missing = [k for k in ("RANK", "LOCAL_RANK") if k not in os.environ]
    if missing:
        raise GptlabError(f"WORLD_SIZE={world} but {missing[0]} is not set: launch with torchrun, or have the launcher "
                          "set RANK (this process's place in the run) and LOCAL_RANK (its place on its node)")
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    options: dict = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise GptlabError(f"LOCAL_RANK={local_rank} but this node shows {visible} GPU(s): start at most {visible} "
                              "process(es) per node (torchrun --nproc-per-node), or check CUDA_VISIBLE_DEVICES")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        options["device_id"] = torch.device(device)  # binds NCCL's communicator to this GPU at once
    try:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", **options)
    except RuntimeError as e:  # a peer that started too late, or that this process cannot reach
        said = _peer_lost(e)
        if said is None:
            raise
        within = "torch's default timeout" if timeout is None else f"distributed_timeout ({timeout:g} s)"
        raise GptlabError(f"process {rank} of {world} did not meet the others within {within} ({said}): start every "
                          "process within it of the first, and check that each reaches MASTER_ADDR:MASTER_PORT"
                          ) from None
    return Processes(rank, world, device, _env_int("LOCAL_WORLD_SIZE", "1"))


def _peer_lost(e: RuntimeError) -> str | None:
    """What a collective's error says, in a few words, when it is about the other processes (torch's DistError,
    NCCL's among them; gloo's transport: a socket closed, a timeout); None for any other error."""
    import torch.distributed as dist

    text = " ".join(str(e).split())
    if not (isinstance(e, dist.DistError) or "gloo/transport" in text):
        return None
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's source file and line
    return text.split(". ", 1)[0]


def _env_int(name: str, default: str | None = None) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)
    except (TypeError, ValueError):
        raise GptlabError(f"the environment variable {name}={text!r} must be a whole number (torchrun sets it)"
                          ) from None


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None = None) -> None:
    """FSDP (PyTorch's fully_shard), in place: each block's parameters, then the rest (embeddings, final norm,
    head), become shards of this process; forward and backward gather each block's weights when it runs.
    `param_dtype`: gather them in this dtype and reduce-scatter gradients in fp32 (None: as they are).
    Call it before building the optimizers: they must hold the shards."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # the public path since torch 2.6; an older CUDA wheel may sit below pyproject's floor
        raise GptlabError(f"distributed = \"fsdp\" needs torch >= 2.6 (torch.distributed.fsdp.fully_shard), this is "
                          f"torch {torch.__version__}: upgrade torch, or use distributed = \"ddp\"") from None

    # the blocks' inputs are left as they come: the residual stream is already in param_dtype (the embeddings'),
    # and RoPE's tables stay fp32 for an attention computed in fp32 (as autocast leaves them)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                                  cast_forward_inputs=False)
    for block in model.iter_blocks():
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def wrap_ddp(module: torch.nn.Module, device: str) -> torch.nn.Module:
    """DistributedDataParallel: every process holds the whole model; gradients are all-reduced in backward."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[device] if device.startswith("cuda") else None)


def gradient_sync(net: torch.nn.Module, model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """A context for one micro-step's backward: exchange gradients only when `sync` (the last micro-step).

    `net` is what forward runs on (maybe DDP-wrapped), `model` the plain, maybe FSDP-sharded, GPT."""
    if not sync and hasattr(net, "no_sync"):  # DDP: all-reduce on the last micro-step only
        return net.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP: reduce-scatter on the last micro-step only
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
