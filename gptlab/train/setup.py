"""What a run starts from: the model (fresh from the recipe, a pretrained one, or a pretrained one under LoRA
adapters) and the dtype check. The memory check is `memory`'s, the random streams a checkpoint saves `rng`'s."""

from __future__ import annotations

from pathlib import Path

import torch

from gptlab.checkpoint import CONFIG_FILE, LORA_FILE, MODEL_FILE, load_weights, read_config, read_tensors
from gptlab.errors import GptlabError
from gptlab.flops import FULL_TRAINING, TrainedWeights
from gptlab.hardware import gpu_has_bf16
from gptlab.lora import LoRASpec, add_lora, has_lora
from gptlab.model import GPT
from gptlab.ops import native_low_precision_matmul
from gptlab.tokenizer import Tokenizer, fingerprint, optional_tokenizer
from gptlab.train.config import TrainConfig, resolve_disable_dropout
from gptlab.train.distributed import shard_model
from gptlab.train.memory import lora_spec
from gptlab.train.precision import sharding_dtype


def resolve_dtype(dtype: str, device: str) -> str:
    """The training dtype for "auto": bfloat16 where the device multiplies bf16 natively; on older GPUs with fp16
    tensor cores (sm70/75) float16, which `Precision` runs with a GradScaler; else float32."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        if gpu_has_bf16(device):
            return "bfloat16"
        return "float16" if torch.cuda.get_device_capability(torch.device(device)) >= (7, 0) else "float32"
    return "bfloat16" if device == "cpu" and native_low_precision_matmul(torch.bfloat16) else "float32"


def check_dtype(dtype: str, device: str) -> None:
    """One-line errors for a training dtype the device cannot run (or only emulates)."""
    if dtype == "float16" and device == "cpu":
        raise GptlabError("dtype float16 is not supported for training on the CPU; use bfloat16 or float32")
    if dtype == "bfloat16" and device.startswith("cuda") and not gpu_has_bf16(device):
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        raise GptlabError(f"dtype bfloat16: this GPU (sm{major}{minor}) has no bfloat16 units (torch would emulate "
                          "them, slowly); use --dtype float16 (loss scaling) or float32")


def build_model(
    cfg: TrainConfig, vocab_size: int, device: str, data_dir: str | Path | None = None, sharded: bool = False
) -> GPT:
    """A fresh GPT from the recipe, or the one `init_from` names (a run, checkpoint or Hugging Face dir), with
    adapters on a frozen copy of it when the recipe sets lora_rank. fp32 masters whatever the saved dtype.
    The tokenizer of `data_dir` must be init_from's own (when both are known).

    A fresh model is built on the meta device and initialized by `init_weights` (the same weights on any device
    and any number of processes). `sharded` (FSDP): nothing whole reaches `device`; `shard` then places it. A
    fresh model stays on the meta device (`shard` materializes only this process's shards), and so does a
    pretrained gptlab checkpoint (`shard` reads this process's rows of each weight from its file); other
    pretrained models (Hugging Face directories, LoRA bases) are loaded into host memory (`shard` moves them to the
    device one block at a time). With disable_dropout (resolved: `resolve_disable_dropout`) its dropouts are
    off (`disable_dropout`)."""
    torch.manual_seed(cfg.seed)  # the same adapters (LoRA's init) and dropout stream of rank 0 on every process
    spec = lora_spec(cfg)
    if not cfg.init_from:
        with torch.device("meta"):
            model = GPT(cfg.model_config(vocab_size)).train()
        if not sharded:
            materialize(model, device)
            init_weights(model, cfg.seed)
    else:
        model = _pretrained(cfg, vocab_size, "cpu" if sharded else device, data_dir, rows=sharded and spec is None,
                            frozen=spec if spec is not None and not sharded else None)
    if spec is not None:
        from gptlab.loading import base_reference  # loading, interop and quantization: only where a run uses them
        from gptlab.qlora import FrozenQuantizedLinear, quantize_base

        if spec.quantize and not any(isinstance(m, FrozenQuantizedLinear) for m in model.modules()):
            quantize_base(model, spec.quantize, spec.group_size)
        add_lora(model, spec, base=base_reference(cfg.init_from))
    if resolve_disable_dropout(cfg).disable_dropout:  # after add_lora: its adapters' dropout too
        disable_dropout(model)
    model.activation_checkpointing = cfg.activation_checkpointing
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of `model` off, in place, as trl's `disable_dropout_in_model`: each nn.Dropout's p set to 0
    (gptlab's attention takes SDPA's dropout_p from one, so it is covered, unlike a transformers model's attention
    dropout, which is a float in its config). The model's config keeps its dropout: a checkpoint saves that, and
    a fine-tune of it has its own. A dropout of p 0 draws no random numbers: the step is the one without it."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def trained_weights(model: GPT) -> TrainedWeights:
    """Which of `model`'s matmul weights train, for MFU's FLOPs (`flops_per_token`): all of a plain model; under
    (Q)LoRA its adapters alone, beside a frozen base and a head that trains only if its weight takes gradients.
    The adapters are counted as `add_lora` shapes them, on the meta device: the same under FSDP's shards."""
    spec: LoRASpec | None = getattr(model, "lora_spec", None)
    if spec is None:
        return FULL_TRAINING
    with torch.device("meta"):
        adapted = add_lora(GPT(model.config), LoRASpec(rank=spec.rank, targets=spec.targets))
    adapters = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    return TrainedWeights(blocks=False, head=model.lm_head.weight.requires_grad, adapters=adapters)


def shard(model: GPT, cfg: TrainConfig, device: str) -> None:
    """FSDP, in place (`shard_model`: fully_shard per block, the compute dtype's policy), of a model from
    `build_model(sharded=True)`: a fresh one is then given this process's shards on `device` alone, initialized
    as `init_weights` initializes a whole model, or reads its rows of each weight from a gptlab checkpoint's file;
    a pretrained model loaded whole moves there block by block, each block whole on the device only while it is
    sharded."""
    fresh = next(model.parameters()).is_meta
    source = getattr(model, "weights_file", None)  # a pretrained checkpoint read in rows
    shard_model(model, sharding_dtype(cfg.dtype, lora=has_lora(model)))
    if fresh:
        model.to_empty(device=device)
        if source is None:
            init_weights(model, cfg.seed)
            return
        current = model.state_dict()  # DTensor shards: each key read as this process's rows of the file
        with torch.no_grad():
            load_weights(model, read_tensors(source, device, shards=current.get), where=f"init_from {source}")


def materialize(model: torch.nn.Module, device: str) -> None:
    """Give every meta parameter and buffer of `model` uninitialized storage on `device`, in place; a tied
    parameter stays one Parameter. What `Module.to_empty` does, without its `empty_like` of meta tensors, whose
    first call imports torch's symbolic-shapes machinery (~0.2 s of a speedrun's start-up)."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor, wrap: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if wrap else new
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = empty(p, wrap=True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b, wrap=False)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT's init (`GPT.initializers`), drawn on the CPU from a generator of its own seeded with `seed`, one whole
    parameter at a time in the order a model built whole draws them, so the weights are the same on any device and
    over any number of processes. Of a sharded parameter each process keeps its part (the rest is dropped): at
    most one parameter's whole fp32 values are in host memory at a time."""
    generator = torch.Generator().manual_seed(seed)
    for param, init in model.initializers():
        values = torch.empty(param.shape, dtype=param.dtype)
        init(values, generator)
        target = param.to_local() if hasattr(param, "to_local") else param
        target.copy_(local_part(values, param))


def local_part(values: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter's whole `values`: all of them, or for an FSDP shard (DTensor, dim 0
    cut as torch.chunk cuts it, an empty part past the last piece) its rows."""
    if not hasattr(param, "device_mesh"):
        return values
    from torch.distributed.tensor import Shard

    mesh = param.device_mesh
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):  # shard_model makes only these
        raise RuntimeError(f"expected a 1-D mesh sharded on dim 0, got {mesh} {param.placements}")
    pieces, rank = torch.chunk(values, mesh.size(), dim=0), mesh.get_local_rank()
    part = pieces[rank] if rank < len(pieces) else values[:0]
    if part.shape != param.to_local().shape:
        raise RuntimeError(f"a shard of shape {tuple(param.to_local().shape)}, its part of {tuple(values.shape)} "
                           f"would be {tuple(part.shape)}")
    return part


def _pretrained(cfg: TrainConfig, vocab_size: int, device: str, data_dir: str | Path | None, rows: bool = False,
                frozen: LoRASpec | None = None) -> GPT:
    """init_from's model, checked against the recipe and data. `rows`: a gptlab checkpoint stays on the meta
    device, its file named in `weights_file` for `shard` (other kinds of model load whole, as without).
    `frozen`: the base of these adapters, read as it will train (`load_frozen_base`: in the compute dtype, QLoRA's
    Linears quantized), never whole in fp32; else fp32 masters."""
    from gptlab.loading import is_hf_dir, load_frozen_base, load_model, resolve_checkpoint

    try:
        directory = resolve_checkpoint(cfg.init_from, prefer="best")
    except GptlabError as e:
        raise GptlabError(f"init_from: {e}") from None
    if frozen is not None:
        dtype = torch.float32 if cfg.dtype in ("float32", "auto") else getattr(torch, cfg.dtype)
        model = load_frozen_base(cfg.init_from, dtype, frozen.quantize, frozen.group_size, device)
        tokenizer, _ = optional_tokenizer(directory)
    elif rows and directory.is_dir() and not is_hf_dir(directory) and not (directory / LORA_FILE).is_file():
        with torch.device("meta"):
            model = GPT(read_config(directory / CONFIG_FILE))
        model.weights_file = directory / MODEL_FILE
        tokenizer, _ = optional_tokenizer(directory)
    else:
        model, tokenizer = load_model(cfg.init_from, device=device, prefer="best")
    if data_dir is not None:
        check_same_tokenizer(cfg.init_from, tokenizer, str(data_dir), optional_tokenizer(data_dir)[0])
    # the architecture comes from the checkpoint: recipe keys may only restate it (or set dropout)
    clash = {k: v for k, v in cfg.model_overrides.items() if k != "dropout" and getattr(model.config, k) != v}
    if clash:
        key = sorted(clash)[0]
        raise GptlabError(f"init_from {cfg.init_from} has {key}={getattr(model.config, key)!r}, the recipe says "
                          f"{clash[key]!r}: with init_from only dropout may change")
    if "dropout" in cfg.model_overrides:
        model.config.dropout = cfg.model_overrides["dropout"]
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = model.config.dropout
    if model.config.vocab_size < vocab_size:
        raise GptlabError(f"{cfg.init_from} has a vocabulary of {model.config.vocab_size}, the data needs "
                          f"{vocab_size}")
    return (model if frozen is not None else model.float()).train()


def check_same_tokenizer(model_path: str, model_tok: Tokenizer | None, data_dir: str, data_tok: Tokenizer | None
                         ) -> None:
    """Refuse data whose ids mean other text than the model's (char data for a GPT-2): it would train, on
    nonsense. Either tokenizer unknown (a model saved without one): nothing to compare."""
    if model_tok is None or data_tok is None:
        return
    ours, theirs = fingerprint(data_tok), fingerprint(model_tok)
    if ours != theirs:
        raise GptlabError(f"--data {data_dir} was tokenized with another tokenizer ({data_tok.kind}, "
                          f"{data_tok.vocab_size} ids, fingerprint {ours}) than init_from {model_path}'s "
                          f"({model_tok.kind}, {model_tok.vocab_size} ids, fingerprint {theirs}): prepare the data "
                          f"with --tokenizer-from {model_path}")
