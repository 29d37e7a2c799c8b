"""How forward and backward run: fp32, autocast (bf16 / fp16 with loss scaling), or bf16 working weights.

The optimizer always owns fp32 master weights (the model passed in). Five modes:
- float32:   forward/backward on the masters.
- autocast:  forward/backward on the masters under torch.autocast; fp16 adds a GradScaler against underflow.
             Used on GPUs and under DDP.
- sharded:   (FSDP) FSDP's mixed-precision policy (`sharding_dtype`): each block's weights are gathered in the
             compute dtype (half the bytes of fp32 all-gathers) and its gradients reduce-scattered in fp32 into the
             fp32 shards; no autocast, which would cast every gathered weight again. fp16 adds a GradScaler.
- working:   (bf16 in a single CPU process) a bf16 copy of the model runs forward/backward; after backward its
             gradients are copied into the masters' .grad in fp32, and after the optimizer step the masters
             are cast back into the copy, each one op over flat buffers (`flat.FlatCopy`); with AdamW, all of
             that is one C++ pass per parameter (`FlatCopy.adamw_step`). Faster on CPU than autocast, which
             re-casts every weight in every forward and keeps the casts for backward.
- frozen:    (LoRA, any device) the frozen base is cast to bf16/fp16 in place (it never changes, so it needs
             no master) and the adapters stay fp32: they are their own masters and compute in fp32 on the
             side (`gptlab.lora.LoRALinear`), as peft does. No copy of the model, no autocast.
In the low-precision modes attention runs in fp32 on a CPU where `attention_fp32` says so: "auto" is decided by
timing bf16's step both ways where `train.autotune` measures the dtype, and elsewhere means heads narrower than 64
(`config.BF16_ATTENTION_MIN_HEAD`): PyTorch's CPU bf16 flash attention backward is slower than fp32 there, and
faster than fp32 with its casts from 64 on. Where gptlab's bf16 attention backward serves the model's heads
(`gptlab.causal_attention.serves`: AVX512-BF16 or AMX, heads and rows in multiples of 32) narrow heads run in bf16
too. On a GPU it runs in the compute dtype: flash and cuDNN attention take only bf16/fp16 inputs.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from gptlab.lora import has_lora
from gptlab.train.flat import FlatCopy
from gptlab.train.optim import step_optimizers, takes_grad_scale


def sharding_dtype(dtype: str, lora: bool) -> torch.dtype | None:
    """The dtype FSDP gathers weights in (its MixedPrecisionPolicy's param_dtype) for a training dtype; None: as
    they are (fp32, or a LoRA run, whose frozen base is cast in place and whose adapters compute in fp32)."""
    return None if dtype == "float32" or lora else getattr(torch, dtype)


class Precision:
    def __init__(
        self, model: torch.nn.Module, dtype: str, device: str, attention_fp32: bool, distributed: bool,
        sharded: bool = False,
    ) -> None:
        self.master = model
        self.device_type = torch.device(device).type
        self.dtype = getattr(torch, dtype)
        self.mode = "float32"
        if dtype != "float32" and has_lora(model):
            self.mode = "frozen"
            with torch.no_grad():
                for p in model.parameters():
                    if not p.requires_grad:
                        p.data = p.data.to(self.dtype)
        elif dtype != "float32" and sharded:  # the model was sharded with `sharding_dtype(dtype)`'s policy
            self.mode = "sharded"
        elif dtype != "float32":
            cpu_bf16 = self.dtype == torch.bfloat16 and self.device_type == "cpu"
            self.mode = "working" if cpu_bf16 and not distributed else "autocast"
        self.scaler = None
        if self.dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(self.device_type)
        self.working = None
        if self.mode == "working":
            self.working = copy.deepcopy(model).to(self.dtype)
            self.flat = FlatCopy(list(zip(self.working.parameters(), model.parameters(), strict=True)))
        if attention_fp32 and self.mode != "float32":
            self.train_module.set_attention_dtype(torch.float32)

    @property
    def train_module(self) -> torch.nn.Module:
        """The module forward/backward run on."""
        return self.working if self.working is not None else self.master

    eval_module = train_module

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode == "autocast":
            return torch.autocast(self.device_type, dtype=self.dtype)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizers: list[torch.optim.Optimizer], grad_clip: float,
             skip: torch.Tensor | None = None) -> None:
        """Gradients to the masters, unscale, clip, step, zero the gradients, refresh the working weights.

        `skip`: a 0-dim bool tensor on the device; where it is true the step changes no weight and no optimizer
        state, decided on the device (`step_optimizers`) so that the host need not wait for this step's loss."""
        if self.working is not None and self.flat.adamw_step(optimizers, grad_clip, skip):
            return  # the working weights are written by the same pass
        if self.working is not None:
            self.flat.grads_to_masters()
        if self.scaler is not None:
            if skip is not None:  # GradScaler skips a step whose gradients are not finite: make them so
                _poison_gradients(optimizers, skip)
            for opt in optimizers:
                self.scaler.unscale_(opt)
        grad_scale = None
        if grad_clip > 0 and self.working is not None:
            if all(takes_grad_scale(opt) for opt in optimizers):  # the fused AdamW divides each gradient by it as
                grad_scale = self.flat.clip_coefficient(grad_clip).reciprocal()  # it reads it: no pass of its own
            else:
                self.flat.clip_(grad_clip)
        elif grad_clip > 0:
            params = [p for p in self.master.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
        if self.scaler is not None:
            for opt in optimizers:
                self.scaler.step(opt)
            self.scaler.update()
        else:
            step_optimizers(optimizers, skip, grad_scale)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        self.sync_weights()

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy the fp32 masters into the working weights (after a step or a checkpoint load)."""
        if self.working is not None:
            self.flat.sync()


def _poison_gradients(optimizers: list, skip: torch.Tensor) -> None:
    """Where `skip` is true, one NaN in a gradient of each optimizer (its smallest), so that GradScaler's own
    check on the device skips the step; otherwise the gradients stay exactly as they are."""
    for opt in optimizers:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            g = min(grads, key=torch.Tensor.numel)
            torch.where(skip, torch.full((), float("nan"), dtype=g.dtype, device=g.device), g, out=g)
