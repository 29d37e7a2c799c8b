"""Faster Linear layers for CPU inference: weights laid out once for the kernel that runs them.

* bf16: `F.linear` hands oneDNN a plain row-major weight, which it re-lays out or runs through a slow generic
  kernel on every call. Packing each weight once in oneDNN's blocked layout (what torch.compile's freezing pass
  does) and calling oneDNN's linear on it gives the same numbers much faster.
  oneDNN packs bf16 only on CPUs with AVX512-BW or AVX-NE-CONVERT; elsewhere (e.g. AVX2-only CPUs) the reorder
  raises, so `packing_helps` tries a tiny one first.
* fp32: MKL's matrix-vector path is faster for x @ W with W stored (in, out) than for x @ W.T with the (out,
  in) nn.Linear weight (the layout transformers' GPT-2 Conv1D uses).
* gptlab's own kernel (`gptlab.kernels`, built once per machine), where `gptlab.kernels.dispatch` measured it to be
  the fastest path for the weights' dtype (on AVX2-only CPUs, AMD Zen 2/3 and older Xeons, oneDNN cannot prepack
  bf16 and torch's bf16 matmul is several times slower than fp32; on AVX-512 CPUs it also beat oneDNN): both bf16
  and fp32 weights go to it, packed in panels of 16 rows, read at close to the memory's bandwidth at batch 1
  (`benchmarks/kernel_throughput.py` prints it against torch's paths). Where the kernels cannot be built, bf16
  stays on the plain forward.

`PackedLinears(model).active()` gives Linear modules the packed forward and restores theirs on exit, so the
model is untouched outside generation. Two things keep this from changing what the model computes:

* Only modules whose class is exactly `nn.Linear` are packed. A subclass (a LoRA layer that adds its low-rank
  update to `super().forward(x)`, a quantized Linear) keeps its own forward, whose extra work a packed forward
  would silently drop; a wrapper module that holds a plain Linear and adds to its output gets that inner Linear
  packed, and its own forward still runs around it.
* The packed copies are snapshots, so each one remembers which weight it was made from: when the weight was
  replaced or changed in place since (an optimizer step, `load_state_dict`, `.to(dtype)`: anything that bumps
  the tensor's version counter or moves its storage), `active()` packs it again. Writes through `weight.data`
  bypass the version counter and are not noticed: pack again after those (`forget_packed`).

`pack_where_it_helps` packs a model once and keeps the copies as long as the model lives, so that every `generate` call
(each builds an engine) does not pack all of it again; they cost one extra copy of the Linear weights in memory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gptlab.kernels import kernel_builds
from gptlab.kernels.dispatch import BATCH, chosen_ops, kind_of
from gptlab.linear import plain_linear

log = logging.getLogger(__name__)


def packing_helps(device: torch.device, dtype: torch.dtype, rows: int = 1, path: str | None = None) -> bool:
    """True where a re-laid-out weight is the faster path and works here: fp32, or bf16 with oneDNN or gptlab's
    own kernel, on a CPU. A `path` naming a build of gptlab's kernels packs both dtypes whatever the dispatch
    picked for their products alone (on an AVX2-only CPU oneDNN cannot pack bf16, but the build can)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.float32 or (path is not None and path in kernel_builds()):
        return True
    return _bf16_packing_works() or chosen_ops("bfloat16", rows) is not None


@functools.cache
def _bf16_packing_works() -> bool:
    """Whether this torch build and CPU can pack and run a bf16 weight: the ops may be missing, or present but
    refuse the CPU (they need AVX512-BW or AVX-NE-CONVERT). Probed once with a tiny weight."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        weight = torch.ones(8, 8, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        _packed_forward(packed, None, torch.ones(1, 8, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError) as e:
        log.debug("bf16 weight packing is not available here: %s", e)
        return False
    return True


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _kernel_forward(ops: Any, out_features: int, packed: torch.Tensor, bias: torch.Tensor | None,
                    x: torch.Tensor) -> torch.Tensor:
    return ops.linear(x, packed, None, bias, out_features)


def _transposed_forward(weight_t: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x @ W with W stored (in, out): the same product as F.linear(x, W.T)."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, flat, weight_t) if bias is not None else flat @ weight_t
    return y.view(*x.shape[:-1], weight_t.shape[1])


def _fingerprint(weight: torch.Tensor) -> tuple:
    """What changes when a weight is written in place (except through `.data`), moved or cast."""
    try:
        version = weight._version
    except RuntimeError:  # a tensor made under inference_mode keeps no version counter
        version = None
    return version, weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape)


@dataclass(eq=False)
class _Pack:
    """One Linear's weight in the kernel's layout, and which weight (and version of it) it was made from."""

    module: nn.Linear
    source: weakref.ref  # the weight packed: a module given a new weight Parameter no longer points at it
    fingerprint: tuple
    kernel: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
    weight: torch.Tensor

    def stale(self) -> bool:
        return self.source() is not self.module.weight or self.fingerprint != _fingerprint(self.module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(self.weight, self.module.bias, x)  # the live bias: it is used as it is


def _pack(module: nn.Linear, batch_hint: int, path: str | None = None) -> _Pack | None:
    """The packed weight of one Linear for `path` (a build of gptlab's kernels, or "torch": PyTorch's path; None:
    the one the dispatch measured fastest for its dtype); None where packing does not help (or fails) for its
    dtype and device."""
    weight = module.weight
    if not packing_helps(weight.device, weight.dtype, batch_hint, path):
        return None
    with torch.no_grad():
        w = weight.detach()
        try:
            ops = chosen_ops(kind_of(w.dtype), batch_hint) if path is None else kernel_builds().get(path)
            if ops is not None:
                kernel, packed = functools.partial(_kernel_forward, ops, w.shape[0]), ops.pack(w)
            elif w.dtype == torch.float32:
                kernel, packed = _transposed_forward, w.t().contiguous()
            else:
                kernel, packed = _packed_forward, torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        except (RuntimeError, NotImplementedError) as e:  # a shape or build oneDNN refuses: the plain forward
            log.debug("not packing a %s weight: %s", tuple(w.shape), e)
            return None
    return _Pack(module, weakref.ref(weight), _fingerprint(weight), kernel, packed)


def _plain_wins_many_rows(pack: _Pack) -> bool:
    """Whether PyTorch's path won the dispatch's large-batch probe for this Linear's kind of weight."""
    return chosen_ops(kind_of(pack.module.weight.dtype), BATCH) is None


def _installed(module: nn.Module) -> _Pack | None:
    """The pack whose forward a Linear runs right now (inside `PackedLinears.active()`), else None."""
    pack = getattr(module.__dict__.get("forward"), "__self__", None)
    return pack if isinstance(pack, _Pack) else None


def kernel_packed(module: nn.Module) -> tuple[Any, torch.Tensor] | None:
    """The build of gptlab's own kernel a Linear runs through (its torch.ops namespace) and the packed weight
    (inside `PackedLinears.active()`), else None."""
    pack = _installed(module)
    if pack is None or getattr(pack.kernel, "func", None) is not _kernel_forward:
        return None
    return pack.kernel.args[0], pack.weight


def kernel_name(module: nn.Module) -> str:
    """Which kernel runs a plain Linear's forward right now (inside or outside `PackedLinears.active()`)."""
    pack = _installed(module)
    if pack is None:
        return f"torch F.linear ({str(module.weight.dtype).removeprefix('torch.')})"
    kernel = getattr(pack.kernel, "func", pack.kernel)
    dtype = str(pack.weight.dtype).removeprefix("torch.")
    if kernel is _kernel_forward:
        return f"{pack.kernel.args[0].name} ({dtype})"  # the build's torch.ops namespace, e.g. gptlab_avx2
    return "oneDNN packed (bfloat16)" if kernel is _packed_forward else f"MKL, transposed weight ({dtype})"


def packable(module: nn.Module) -> bool:
    """Exactly nn.Linear or gptlab's Linear: a subclass's forward may do more than the product (see the module
    docstring)."""
    return plain_linear(module)


def _layout(model: nn.Module, batch_hint: int, path: str | None) -> tuple:
    """Which Linear modules a model has, their weights' dtypes and devices: what packing them depends on."""
    linears = (m for m in model.modules() if packable(m))
    return batch_hint, path, tuple((id(m), m.weight.dtype, m.weight.device) for m in linears)


class PackedLinears:
    """Packed copies of a model's plain Linear weights; see the module docstring. With `path` (a build of
    `gptlab.kernels`, or "torch"), every Linear goes to that path whatever the dispatch picked for its products
    alone: on a build the blocks run in the one-call C++ decode step, on "torch" in the lean step
    (`generation.step_choice` times which whole step is faster)."""

    def __init__(self, model: nn.Module, batch_hint: int = 1, path: str | None = None) -> None:
        self.batch_hint, self.path = batch_hint, path
        self.layout = _layout(model, batch_hint, path)
        packs = (_pack(m, batch_hint, path) for m in model.modules() if packable(m))
        self.packs = [p for p in packs if p is not None]
        if path is not None:  # the large-batch choice a big prefill asks for (`active`), probed here at start-up:
            for p in self.packs:  # in a server's first big prefill it stalled every running row for the probe
                _plain_wins_many_rows(p)

    @property
    def modules(self) -> list[nn.Linear]:
        """The Linear modules that run packed."""
        return [p.module for p in self.packs]

    def refresh(self) -> int:
        """Pack again every weight that changed since it was packed (a weight that can no longer be packed, e.g.
        cast to a dtype packing does not help, goes back to the plain forward); returns how many changed."""
        stale = [p for p in self.packs if p.stale()]
        if stale:
            repacked = {id(p): _pack(p.module, self.batch_hint, self.path) for p in stale}
            self.packs = [repacked.get(id(p), p) for p in self.packs]
            self.packs = [p for p in self.packs if p is not None]
        return len(stale)

    @contextlib.contextmanager
    def active(self, refresh: bool = True, only: nn.Module | None = None, many_rows: bool = False) -> Iterator[None]:
        """Run the packed forwards inside the block (packing stale weights again first, unless `refresh` is False:
        an engine checks at each prefill, not every step); with `only`, that module's alone (the C++ decode step
        reads the packs itself and leaves the LM head to its module). With `many_rows` (a prefill of at least the
        dispatch's large-batch size) on a `path` chosen for the decode step, the Linears keep their plain forward
        where the dispatch measured PyTorch's product the faster one at that size."""
        if refresh:
            self.refresh()
        # a module whose forward someone else has already replaced keeps it (and gets it back on exit)
        packs = self.packs if only is None else [p for p in self.packs if p.module is only]
        if many_rows and self.path is not None:
            packs = [p for p in packs if not _plain_wins_many_rows(p)]
        installed = [p for p in packs if "forward" not in p.module.__dict__]
        for p in installed:  # an instance attribute shadows Linear.forward (set directly: this runs every step)
            p.module.__dict__["forward"] = p.forward
        try:
            yield
        finally:
            for p in installed:
                p.module.__dict__.pop("forward", None)


_PACKED: weakref.WeakKeyDictionary[nn.Module, PackedLinears] = weakref.WeakKeyDictionary()  # model -> its packs


def pack_where_it_helps(model: nn.Module, batch_hint: int = 1, path: str | None = None) -> PackedLinears | None:
    """The model's PackedLinears where packing helps and works for some Linear; None (plain linears) otherwise.

    Packed on the first call and reused by the next ones (`active()` packs again the weights that changed), or
    packed anew when the Linear modules, their dtypes or devices, the batch hint or `path` differ from last time."""
    packed = _PACKED.get(model)
    # weights made under inference_mode keep no version counter: a write to them could not be noticed later
    untracked = packed is not None and any(p.fingerprint[0] is None for p in packed.packs)
    if packed is None or untracked or packed.layout != _layout(model, batch_hint, path):
        packed = _PACKED[model] = PackedLinears(model, batch_hint, path)
    return packed if packed.packs else None


def forget_packed(model: nn.Module) -> None:
    """Drop the model's packed copies (their memory; a write through `weight.data` they could not notice)."""
    _PACKED.pop(model, None)
