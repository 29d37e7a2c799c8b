"""The torch random streams dropout draws from, one per process: seeded apart after the identical init, saved in
every step checkpoint, put back on resume.

- Every process builds the model from `seed` (the same init everywhere, `setup.build_model`); `seed_dropout` then
  gives each rank r > 0 a stream of its own (seed + r, as nanoGPT seeds 1337 + rank), or every rank would draw the
  same dropout masks for the whole run. Rank 0 keeps the stream it has after init, so one process runs as before.
  Only the generator dropout draws from is reseeded: the device's CUDA generator on a GPU, the CPU one on a CPU.
- A checkpoint holds each rank's own states (`rng_state`, gathered from every process): the CUDA state of its own
  device (not one per visible GPU: a resume where fewer are visible could not put those back), and its CPU state
  where it differs from rank 0's (on GPUs the CPU generators are all alike, and one is kept).
- `restore_rng_state` gives rank r the states saved for rank r; a rank the checkpoint lacks (more processes than
  were saved, or a checkpoint from before per-rank states) gets a stream of its own from (seed, rank, step).
  Resuming on the same number of processes is therefore exact. On another number, the data order stays exact
  (each step's global batch is a function of (seed, step)), but a row that moves to another process, or to
  another micro-step of the same process, meets other dropout masks.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from gptlab.train.distributed import Processes


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of rank `rank`'s own stream from step `step` on (seed + rank at the start)."""
    return (seed + rank + step * 2**32) % 2**63


def seed_dropout(seed: int, procs: Processes) -> None:
    """After the identical init: a dropout stream of its own for every rank but 0."""
    if procs.rank:
        _seed(procs.device, rank_seed(seed, procs.rank))


def _seed(device: str, seed: int) -> None:
    if device.startswith("cuda"):
        with torch.cuda.device(torch.device(device)):
            torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def own_state(device: str) -> dict[str, str]:
    """This process's states: the CPU generator's and, on a GPU, its own device's (base64)."""
    state = {"torch": _b64(torch.get_rng_state())}
    if device.startswith("cuda"):
        state["cuda"] = _b64(torch.cuda.get_rng_state(torch.device(device)))
    return state


def rng_state(procs: Processes, gather: bool = True) -> dict[str, Any]:
    """state.json's "rng": {"torch": rank 0's CPU state, "ranks": [each rank's CUDA state, and its CPU state where
    it is not rank 0's]}. A collective when `gather` (every process must call it); without, only this process's
    own (for a checkpoint written after an error, when the peers may be elsewhere)."""
    ranks = procs.gather(own_state(procs.device)) if gather else [own_state(procs.device)]
    first = ranks[0]["torch"]
    return {"torch": first, "ranks": [{k: v for k, v in r.items() if k != "torch" or v != first} for r in ranks]}


def restore_rng_state(state: dict[str, Any], procs: Processes, seed: int, step: int) -> None:
    """Put back this rank's states from a checkpoint's "rng" (see the module's docstring for what is exact)."""
    rank, cuda = procs.rank, procs.device.startswith("cuda")
    if "ranks" in state:
        saved = state["ranks"][rank] if rank < len(state["ranks"]) else None
        cpu = state["torch"] if rank == 0 else saved.get("torch") if saved else None
        gpu = saved.get("cuda") if saved else None
    else:  # a checkpoint from before per-rank states: rank 0's CPU state, a CUDA state per GPU rank 0 saw
        cpu = state["torch"] if rank == 0 else None
        index = torch.device(procs.device).index or 0
        visible = state.get("cuda") or []
        gpu = visible[index] if rank == 0 and index < len(visible) else None
    if cpu is None and cuda:
        cpu = state["torch"]  # dropout on a GPU draws from its CUDA generator: the CPU ones stay alike
    if cpu is not None:
        torch.set_rng_state(_tensor(cpu))
    else:
        torch.default_generator.manual_seed(rank_seed(seed, rank, step))
    if cuda:
        if gpu is not None:
            torch.cuda.set_rng_state(_tensor(gpu), torch.device(procs.device))
        else:
            _seed(procs.device, rank_seed(seed, rank, step))
