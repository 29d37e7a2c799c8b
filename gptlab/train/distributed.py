"""Training over several processes (torchrun): joining the group, wrapping the model, deciding together.

torchrun starts one process per device and tells each its place through RANK / WORLD_SIZE / LOCAL_RANK.
Everything that needs more than one process lives here, so the trainer reads the same with one or many:

- `init_distributed` joins the process group (NCCL on GPUs, gloo on CPUs) or, alone, does nothing;
- the model is either replicated (`wrap_ddp`: gradients all-reduced) or sharded (`shard_model`: FSDP);
- `gradient_sync` skips the gradient exchange on all but the last micro-step of gradient accumulation;
- decisions that every process must take alike (stop on a signal, stop on the clock, save a new best) go
  through `Processes.sum_and_any` and `Processes.from_rank0`, or a process would wait forever in a
  collective its peers never enter;
- `Processes.close` leaves together: a rank that exits while a peer still writes a checkpoint can abort gloo's
  teardown ("terminate called ...").
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Processes:
    """This process's place in the run: rank, how many processes there are, and its device."""

    rank: int
    world: int
    device: str

    @property
    def is_master(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    def sum_and_any(self, value: torch.Tensor, flag: bool) -> tuple[torch.Tensor, torch.Tensor | bool]:
        """The sum of a scalar tensor over all processes, and whether `flag` is set on any of them, both left on
        the device (one all-reduce, no host read); alone, `value` and `flag` themselves."""
        if self.world == 1:
            return value, flag
        import torch.distributed as dist

        t = torch.stack([value.float(), torch.full((), 1.0 if flag else 0.0, device=value.device)])
        dist.all_reduce(t)
        return t[0], t[1] > 0

    def from_rank0(self, value: float) -> float:
        """Rank 0's value on every process."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=0)
        return float(t[0])

    def close(self, clean: bool) -> None:
        """Leave the process group; after a clean run, first wait for every peer to get here."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if clean:  # after an error a peer may never arrive: don't wait for it
            dist.barrier()
        dist.destroy_process_group()


def init_distributed(device: str) -> Processes:
    """Join torchrun's process group (each process takes the GPU of its LOCAL_RANK); alone, just `device`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Processes(0, 1, device)
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Processes(rank, world, device)


def shard_model(model: torch.nn.Module) -> None:
    """FSDP (PyTorch's fully_shard), in place: each block's parameters, then the rest (embeddings, final norm,
    head), become shards of this process; forward and backward gather each block's weights when it runs.
    Call it before building the optimizers: they must hold the shards."""
    from torch.distributed.fsdp import fully_shard

    for block in model.iter_blocks():
        fully_shard(block)
    fully_shard(model)


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
