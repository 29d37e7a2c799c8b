"""The memory check: the bytes one training step needs per process, estimated from the config alone (the model
built on the meta device, where it costs nothing), printed before the first step, and a run that cannot fit
refused before any work.

What it counts (`step_memory`), in the dtypes the run keeps them in:
- weights: a model trained whole keeps fp32 masters (4 bytes a parameter). LoRA keeps its frozen base in the
  compute dtype (`train/precision.py`'s "frozen" mode) and the adapters in fp32; QLoRA's block Linears as their
  integers and scales (`qlora.py`: int8 one byte a weight + an fp32 scale per row, int4 half a byte + an fp16
  scale and low end per group).
- states: a gradient and AdamW's two moments per trainable parameter (12 bytes); training whole under low
  precision without FSDP also the weights' low-precision copies (autocast's casts kept for backward, or the working
  copy); under FSDP each process holds 1/world of the states plus what it gathers: the root's weights
  (embeddings, head, final norm) and one block's, with their gradients, in the compute dtype. An objective with a
  reference (dpo, ipo, grpo with kl_beta) trained whole keeps a frozen copy of the weights in the compute dtype
  (under LoRA the reference is the base itself: nothing more).
- activations, in the compute dtype: the logits with their gradient, and what each block keeps for backward (the
  residual, norms, q/k/v, the attention output: 8 values per channel; the MLP's hidden layer: 2, gated 4, values
  per hidden unit); under activation checkpointing only each block's input, plus one block recomputed. QLoRA adds
  the one block of a weight it dequantizes at a time, in the compute dtype.

A lower bound: the allocator's slack, the framework itself and temporaries beyond these are not counted.
A pretrained model's weights are in memory already when the check runs: it compares what is still to come.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import human_bytes
from gptlab.flops import parameter_counts
from gptlab.hardware import available_memory
from gptlab.lora import LoRASpec, add_lora, parse_targets
from gptlab.model import GPT
from gptlab.train.config import TrainConfig


@dataclass(frozen=True)
class StepMemory:
    """A training step's bytes per process, by what holds them (see the module docstring)."""

    weights: int
    states: int
    activations: int
    loaded: bool  # the weights are in memory already (a pretrained model)

    @property
    def total(self) -> int:
        return self.weights + self.states + self.activations

    @property
    def to_come(self) -> int:
        """What the step still has to allocate."""
        return self.total - (self.weights if self.loaded else 0)

    def describe(self) -> str:
        return (f"memory per step: at least {human_bytes(self.total)} (weights {human_bytes(self.weights)}, "
                f"gradients and optimizer state {human_bytes(self.states)}, activations "
                f"{human_bytes(self.activations)})")


def lora_spec(cfg: TrainConfig) -> LoRASpec | None:
    """The recipe's adapters, or None for full training."""
    if not cfg.lora_rank:
        return None
    return LoRASpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                    targets=parse_targets(cfg.lora_targets), quantize=cfg.quantize)


def step_memory(cfg: TrainConfig, config: GPTConfig, world: int, fresh: bool, device: str = "cpu") -> StepMemory:
    """The bytes one training step of `config` under `cfg` needs on each of `world` processes of `device`'s type;
    `fresh`: a model built from the recipe (else loaded: its weights are in memory already)."""
    elt = 4 if cfg.dtype == "float32" else 2  # "auto" is resolved before the trainer asks; 2 is the lower bound
    fsdp = cfg.distributed == "fsdp" and world > 1
    if cfg.lora_rank:
        weights, trainable, dequantized = adapted_weights(cfg, config, elt, torch.device(device))
        states = 12 * trainable
        if fsdp:
            weights, states = weights // world, states // world
    else:
        total, block, root = parameter_counts(config)
        weights, dequantized = 4 * total // (world if fsdp else 1), 0
        if fsdp:
            states = 12 * total // world + 2 * elt * (root + block)
        else:
            states = 12 * total + (2 * total if elt == 2 else 0)
        if cfg.objective in ("dpo", "ipo") or (cfg.objective == "grpo" and cfg.kl_beta > 0):
            states += elt * total
    tokens = cfg.batch_size // max(world * cfg.grad_accum, 1) * config.block_size
    per_block = 8 * config.n_embd + (4 if config.gated_mlp else 2) * config.hidden_size
    if cfg.activation_checkpointing:
        kept = config.n_layer * config.n_embd + per_block
    else:
        kept = config.n_layer * per_block
    activations = elt * tokens * (2 * config.vocab_size + kept) + dequantized
    return StepMemory(weights, states, activations, loaded=not fresh)


def adapted_weights(cfg: TrainConfig, config: GPTConfig, elt: int, device: torch.device) -> tuple[int, int, int]:
    """(bytes of a LoRA run's weights as it trains, its trainable parameters, the bytes of QLoRA's one
    dequantized block at a time on `device`): the model built on the meta device, quantized and adapted as
    training does."""
    from gptlab.qlora import FrozenQuantizedLinear, quantize_base, workspace_elements  # only for a LoRA run

    with torch.device("meta"):
        model = GPT(config)
        spec = lora_spec(cfg)
        if spec.quantize:
            quantize_base(model, spec.quantize, spec.group_size)
        add_lora(model, spec)
    weights = trainable = 0
    for p in model.parameters():
        trainable += p.numel() if p.requires_grad else 0
        weights += p.numel() * (4 if p.requires_grad else elt)
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    largest = max((workspace_elements(m, device) for m in model.modules() if isinstance(m, FrozenQuantizedLinear)),
                  default=0)
    return weights, trainable, largest * elt


def check_step_memory(cfg: TrainConfig, config: GPTConfig, world: int, device: str, fresh: bool = True,
                      quiet: bool = True, processes_here: int = 1) -> StepMemory:
    """Print the estimate (unless `quiet`) and refuse before any work a batch (or model) that cannot fit in the
    device's free memory; returns the estimate. `processes_here`: the run's processes on this machine, which on a
    CPU all take their steps' memory from the same RAM (each GPU has its own)."""
    need, have = step_memory(cfg, config, world, fresh, device), available_memory(device)
    sharing = processes_here if torch.device(device).type == "cpu" else 1
    if not quiet:
        print(need.describe() + ("" if have is None else f"; {human_bytes(have)} free on {device}"))
    if have is not None and need.to_come * sharing > have:
        params = parameter_counts(config)[0]
        more = "" if cfg.activation_checkpointing else ", set activation_checkpointing = true"
        shared = (f" per process, x {sharing} processes on this machine: {human_bytes(need.to_come * sharing)}"
                  if sharing > 1 else "")
        raise GptlabError(f"training this model ({params:,} parameters) at batch_size {cfg.batch_size} x block_size "
                          f"{config.block_size} needs at least {human_bytes(need.to_come)} of memory per step"
                          f"{' beyond its loaded weights' if need.loaded else ''}{shared}, {device} has "
                          f"{human_bytes(have)} free: lower batch_size or micro_batch_size{more}, or choose a smaller "
                          "model")
    return need
