"""Any model path in, a model out: a run directory, a gptlab checkpoint, a Hugging Face model directory or a GGUF file.

Every command that reads a model (`sample`, `eval`, `serve`, `convert`, training's `init_from`) comes through
`load_model`, so each of them takes every kind of path:

* a checkpoint directory: `model.safetensors` + `config.json` (gptlab's format, `gptlab.checkpoint`);
* a Hugging Face directory: a `config.json` with a `model_type` (read by `gptlab.interop`);
* a GGUF file (llama.cpp's format, `interop.gguf_read`): its weights dequantized, its tokenizer and chat template;
* a run directory (`gptlab train --out`): its best checkpoint, or its latest step (`prefer`);
* a LoRA run's checkpoint (adapters + lora.json naming the base): the base is loaded from its recorded path,
  checked against its recorded sha256, and the adapters are put on it (merged into its weights unless asked
  to keep them separate; both compute the same function).

Moving a model between the formats is `gptlab.conversion`'s (`convert`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gptlab.checkpoint import (
    BEST_NAME,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LORA_CONFIG,
    LORA_FILE,
    MODEL_FILE,
    STATE_FILE,
    check_plain_shapes,
    has_weights,
    list_step_checkpoints,
    load_adapter_tensors,
    load_gptlab_model,
    plain_shapes,
    read_config,
    read_lora_config,
    stream_tensors,
    weights_sha256,
    with_tied_head,
)
from gptlab.errors import GptlabError
from gptlab.fileio import parse_json
from gptlab.hardware import resolve_device, weights_dtype
from gptlab.interop import from_hf
from gptlab.interop.gguf_read import is_gguf_file, load_gguf
from gptlab.lora import LoRAError, add_lora, merge_lora
from gptlab.model import GPT
from gptlab.qlora import base_linears, quantize_base, quantize_layer
from gptlab.quantize import check_options as check_quantize_options
from gptlab.quantize import quantize_model
from gptlab.tokenizer import Tokenizer, optional_tokenizer


def is_hf_dir(path: Path) -> bool:
    """True for a directory whose config.json names a Hugging Face `model_type`."""
    cfg = path / CONFIG_FILE
    if not cfg.is_file():
        return False
    try:
        values = parse_json(cfg.read_text())
    except (OSError, ValueError):
        return False  # not a Hugging Face directory: gptlab's reader names what is wrong with the file
    return isinstance(values, dict) and "model_type" in values


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint directory (or Hugging Face directory) from a run, checkpoint or HF path.

    For a run directory, `prefer="best"` picks the best-validation checkpoint when there is one, else the
    latest; `prefer="latest"` picks the latest step.
    """
    if prefer not in ("best", "latest"):  # anything else silently meant "latest"
        raise GptlabError(f"prefer must be 'best' or 'latest', got {prefer!r}")
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise GptlabError(f"{path} is a symbolic link that leads nowhere (a loop, or its target is gone)")
    if not path.exists():
        raise GptlabError(f"{path} does not exist: pass a run directory, a checkpoint directory, a "
                          "Hugging Face one or a GGUF file")
    if path.is_file():
        if path.name == MODEL_FILE:
            return path.parent
        if is_gguf_file(path):
            return path
        raise GptlabError(f"{path} is a file: pass a GGUF file or the directory that holds {MODEL_FILE} and "
                          f"{CONFIG_FILE}")
    if has_weights(path) and (path / CONFIG_FILE).is_file() or is_hf_dir(path):
        return path
    best = path / CHECKPOINTS_DIR / BEST_NAME
    steps = list_step_checkpoints(path)
    if prefer == "best" and has_weights(best):
        return best
    if prefer == "best" and steps and _had_best(steps[-1]):
        # the run evaluated, so a best existed: never fall back to the latest step without saying so
        kept = [d for d in (path / CHECKPOINTS_DIR).glob(f".{BEST_NAME}.old-*") if has_weights(d)]
        if kept:
            print(f"note: {best} is missing (a run stopped while replacing it); using its previous copy {kept[0]}",
                  file=sys.stderr)
            return kept[0]
        print(f"note: {best} is missing though the run evaluated; using the latest step {steps[-1].name} (pass "
              f"{steps[-1]} to choose explicitly)", file=sys.stderr)
    if steps:
        return steps[-1]
    if has_weights(best):
        return best
    raise GptlabError(f"no checkpoint found in {path}: expected {MODEL_FILE} + {CONFIG_FILE}, a run "
                      f"directory with {CHECKPOINTS_DIR}/step-*/, or a Hugging Face model directory")


def _had_best(step_dir: Path) -> bool:
    """Whether a step checkpoint's state.json records a best validation loss (so checkpoints/best/ was written)."""
    try:
        return parse_json((step_dir / STATE_FILE).read_text()).get("best_val_loss") is not None
    except (OSError, ValueError, AttributeError):
        return False


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    prefer: str = "best",
    merge_adapters: bool = True,
    quantize: str | None = None,
    group_size: int | None = None,
) -> tuple[GPT, Tokenizer | None]:
    """Load (model, tokenizer) from a run, checkpoint or Hugging Face directory (tokenizer: None if none).
    `device`: cpu, cuda, cuda:N, mps or auto; `dtype`: a floating-point dtype or its name (None: as stored).

    A LoRA checkpoint comes back as its base with the adapters merged into the weights (a plain GPT, as fast as
    the base), or with `merge_adapters=False` with LoRA layers computing the update on the side.

    `quantize` ("int8" or "int4", with `group_size` for int4) quantizes the weights of its Linear layers for
    inference (`gptlab.quantize`), from the fp32 weights; the rest of the model then takes `dtype`."""
    check_quantize_options(quantize, group_size)
    # checked before reading anything: a device this machine lacks failed inside safetensors (CUDA as
    # "pin_memory=True requires a CUDA ... backend"), a dtype's name as a TypeError from Module.to
    device = resolve_device(str(device), flag="device")
    dtype = weights_dtype(dtype)
    if quantize is not None and not merge_adapters:
        raise GptlabError("cannot quantize a model whose LoRA adapters are kept unmerged: merge them (the default)")
    directory = resolve_checkpoint(path, prefer=prefer)
    # quantizing reads fp32 weights, in host memory: only the integers reach a GPU, so a model whose int4 weights
    # fit the card loads even where its fp32 weights would not
    load_dtype, load_device = (torch.float32, "cpu") if quantize else (dtype, device)
    tokenizer = None
    if directory.is_file():  # a GGUF file: the only file resolve_checkpoint lets through
        model, tokenizer = load_gguf(directory, device=load_device, dtype=load_dtype)
    elif is_hf_dir(directory):
        model = from_hf(directory, device=load_device, dtype=load_dtype)
    elif (directory / LORA_FILE).is_file():
        model = load_lora_model(directory, device=load_device, dtype=load_dtype, merge=merge_adapters)
    else:
        model = load_gptlab_model(directory, device=load_device, dtype=load_dtype)
    if quantize:
        model = quantize_model(model.eval(), quantize, group_size).to(device=device, dtype=dtype)
    if tokenizer is None:
        tokenizer, _ = optional_tokenizer(directory)
    if tokenizer is None and (directory / LORA_FILE).is_file():  # adapters trained on data without a tokenizer
        tokenizer, _ = optional_tokenizer(resolve_checkpoint(read_lora_config(directory)[1]["path"]))
    return model, tokenizer


def load_frozen_base(path: str | Path, dtype: torch.dtype, quantize: str | None = None,
                     group_size: int | None = None, device: str | torch.device = "cpu") -> GPT:
    """The model `path` names as LoRA's frozen base: QLoRA's block Linears quantized (`qlora.quantize_base`, from
    the weights in fp32, as `load_lora_model` quantizes them again), every other weight in `dtype`.

    A gptlab checkpoint is read one tensor at a time (`stream_tensors`), each converted before the next is read:
    neither its file nor the model in fp32 is ever in memory whole, so the peak is about the base as it trains
    (a QLoRA int4 base: about a quarter of its bf16 bytes) plus one tensor. Other models load whole, then convert."""
    directory = resolve_checkpoint(path, prefer="best")
    _refuse_gguf_base(path, directory)  # before its config.json is looked for
    if is_hf_dir(directory) or (directory / LORA_FILE).is_file():  # quantizing widens each weight to fp32 itself
        model, _ = load_model(path, prefer="best", dtype=None if quantize else dtype)
        if quantize:
            quantize_base(model, quantize, group_size)
        return _frozen(model, dtype, device)
    config = read_config(directory / CONFIG_FILE)
    with torch.device("meta"):
        model = GPT(config)
    where = f"{directory / MODEL_FILE} (against {directory / CONFIG_FILE})"
    shapes, tensors = stream_tensors(directory / MODEL_FILE)
    check_plain_shapes(plain_shapes(config), with_tied_head(dict(shapes), config), where)
    check_quantize_options(quantize, group_size)
    linears = {f"{name}.weight": name for name, _ in base_linears(model)} if quantize else {}
    for key, tensor in tensors:
        if key in linears:  # its bias, if any, is read first or later: either way a buffer of the layer
            # as read: quantizing widens a block of rows at a time to fp32
            model.get_submodule(linears[key]).weight = torch.nn.Parameter(tensor, requires_grad=False)
            quantize_layer(model, linears[key], quantize, group_size)
        else:
            model.load_state_dict({key: tensor.to(dtype)}, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    return _frozen(model, dtype, device)


def _frozen(model: GPT, dtype: torch.dtype, device: str | torch.device) -> GPT:
    """The model's parameters in `dtype` on `device`, frozen (quantized layers' integers and scales as they are)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(device=device, dtype=dtype)
            p.requires_grad_(False)
    return model.to(device).eval()


def _refuse_gguf_base(path: str | Path, directory: Path) -> None:
    """A LoRA base must be safetensors weights (its run records their sha256): a GGUF file is converted first."""
    if directory.is_file():  # a GGUF file: the only file resolve_checkpoint lets through
        raise GptlabError(f"{path} is a GGUF file: a LoRA run records its base's safetensors weights; convert it "
                          f"first (`gptlab convert {path} BASE`) and adapt BASE")


def base_reference(path: str | Path) -> dict[str, str]:
    """{"path", "sha256"} of the model a LoRA run adapts: the checkpoint or Hugging Face directory `path` means."""
    directory = resolve_checkpoint(path).resolve()
    _refuse_gguf_base(path, directory)
    if (directory / LORA_FILE).is_file():
        raise GptlabError(f"{path} holds LoRA adapters, not a whole model: merge them first (`gptlab convert "
                          f"{path} OUT --to gptlab`) and adapt that")
    return {"path": str(directory), "sha256": weights_sha256(directory)}


def load_lora_model(
    directory: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, merge: bool = True
) -> GPT:
    """A LoRA checkpoint's base (checked against its recorded sha256) with its adapters, merged or not."""
    spec, base = read_lora_config(directory)
    base_dir = Path(base["path"])
    if not base_dir.is_dir():
        raise GptlabError(f"{directory}'s adapters belong to the base {base_dir}, which does not exist any more: "
                          "put it back there (or edit lora.json's base.path to where it is now)")
    if (resolve_checkpoint(base_dir) / LORA_FILE).is_file():  # gptlab never writes one: a loop, or a chain
        raise GptlabError(f"{directory / LORA_CONFIG}: base.path {base_dir} holds LoRA adapters itself, not a whole "
                          "model: a LoRA checkpoint's base must be a plain model")
    if weights_sha256(base_dir) != base["sha256"]:
        raise GptlabError(f"the base {base_dir} has changed since {directory}'s adapters were trained on it "
                          "(its weights' sha256 differs): the adapters would not fit it")
    model, _ = load_model(base_dir, device=device, dtype=torch.float32)
    try:
        if spec.quantize:  # the base the adapters were trained on (QLoRA): merged, it is dequantized
            quantize_base(model, spec.quantize, spec.group_size)
        add_lora(model, spec, base=base)
    except LoRAError as e:
        raise GptlabError(f"{directory / LORA_CONFIG}: {e}") from None
    model.load_state_dict(load_adapter_tensors(directory, model), strict=False)
    if merge:
        merge_lora(model)
    return model.to(device=device, dtype=dtype).eval()
