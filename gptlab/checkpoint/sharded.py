"""One safetensors file written by every process of an FSDP run at once, each process its own rows.

FSDP keeps each weight and optimizer moment as a DTensor sharded by rows (`Shard(0)`): process r holds a
contiguous block of rows, which is a contiguous range of bytes in a safetensors file of the whole tensor (the
format is a JSON header and then each tensor's bytes, row-major). So the writer lays the file out (the header, and
the file's full size, which costs no disk until written), tells every process where it is, and each process writes
its blocks at their offsets. Nothing is gathered: a process holds one of its own shards on the CPU at a time,
where gathering to a writer held every whole tensor there (84 GB for a 7B model and its AdamW moments). The
result is the same one file of whole tensors a single process writes, read back in slices on resume
(`reading.read_tensors(shards=)`) or whole by everything else.

A failure anywhere (a full disk, an unwritable file) is voted on: every process raises, the writer with the
`OSError` its atomic write turns into the usual one-line message, so no process trains on without a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from gptlab.checkpoint.layout import SAFETENSORS_DTYPES
from gptlab.errors import GptlabError

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def row_sharded(t: torch.Tensor) -> bool:
    """A DTensor split by rows over one mesh dimension (FSDP's layout), whose rows this process can write."""
    from torch.distributed.tensor import Shard

    placements = getattr(t, "placements", None)
    return placements is not None and len(placements) == 1 and placements[0] == Shard(0)


def applies(*groups: dict[str, torch.Tensor]) -> bool:
    """Whether these tensors are written in rows: some are row-sharded DTensors and every DTensor is."""
    tensors = [t for g in groups for t in g.values()]
    dtensors = [t for t in tensors if hasattr(t, "placements")]
    return bool(dtensors) and all(row_sharded(t) for t in dtensors) and dist.is_initialized()


def global_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())  # a DTensor's numel is the whole tensor's


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The file's header (safetensors: a little-endian u64 length, then JSON padded to 8 bytes), the tensors'
    bytes following it in the order of their names."""
    header: dict[str, object] = {"__metadata__": metadata}
    begin = 0
    for name in sorted(tensors):
        t = tensors[name]
        end = begin + t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _starts(fd: int) -> dict[str, int]:
    """Where each tensor's bytes start in a laid-out file, read from its own header."""
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, length, 8))
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


def create(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """The writer's part before the others': the header, and the file at its full size (a sparse file); called as
    `save_tensors` is."""
    head = _header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + global_nbytes(tensors))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def write_rows(path: Path, tensors: dict[str, torch.Tensor], writer: bool) -> None:
    """Write this process's rows of each row-sharded tensor, and on the writer the whole of every other tensor
    (those are the same on every process: a step count, an unsharded buffer)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    fd = os.open(path, os.O_RDWR)
    try:
        starts = _starts(fd)
        for name, t in tensors.items():
            if row_sharded(t):
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                local, first = t.to_local(), offset[0]
                if 0 in shape:  # more processes than rows: this one holds none
                    continue
            elif writer:
                local, first = t, 0
            else:
                continue
            row_bytes = math.prod(t.shape[1:]) * t.element_size()
            data = local.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            _pwrite_all(fd, memoryview(data), starts[name] + first * row_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def share_directory(directory: Path | None, src: int = 0) -> Path | None:
    """The writer's temporary directory, sent to every process (None: the writer failed before making it)."""
    box = [None if directory is None else str(directory)]
    dist.broadcast_object_list(box, src=src)
    return None if box[0] is None else Path(box[0])


def write_everywhere(files: dict[Path, dict[str, torch.Tensor]], writer: bool) -> None:
    """Every process writes its rows of each file, then all learn whether every process succeeded."""
    error: OSError | None = None
    try:
        for path, tensors in files.items():
            write_rows(path, tensors, writer)
    except OSError as e:
        error = e
    failed = torch.tensor([error is not None], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        raise GptlabError("the checkpoint was not written: another process could not write its part of it")


def _collective_device() -> torch.device:
    """Where this process group's collectives take tensors (NCCL: this process's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def save_in_rows(write_directory: Callable[[Callable[[Path], None]], Path], lay_out: Callable[[Path], None],
                 files: Callable[[Path], dict[Path, dict[str, torch.Tensor]]], writer: bool) -> Path | None:
    """Run a checkpoint write in which every process writes its rows. The writer's `write_directory(write)` makes
    the temporary directory and swaps it in when `write` returns (`fileio.atomic_write_dir`); `lay_out(tmp)` writes
    what the writer alone writes (its JSON files, each tensor file's header); `files(tmp)` names each tensor file and
    its tensors. Returns the checkpoint's path on the writer, None elsewhere."""
    if not writer:
        tmp = share_directory(None)
        if tmp is None:
            raise GptlabError("the checkpoint was not written: the writing process failed (its error says why)")
        write_everywhere(files(tmp), writer=False)
        return None
    shared = False

    def write(tmp: Path) -> None:
        nonlocal shared
        lay_out(tmp)
        share_directory(tmp)
        shared = True
        write_everywhere(files(tmp), writer=True)

    try:
        return write_directory(write)
    except BaseException:
        if not shared:  # the others are waiting to hear where to write
            share_directory(None)
        raise
