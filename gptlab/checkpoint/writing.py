"""Writing checkpoints: a model's (`save_model`) and a training run's (`save_checkpoint`), and pruning old ones.

Every write goes through a temporary directory swapped into place (`gptlab.fileio`, which also leaves its
`.gptlab` marker in each), so a crash leaves the previous checkpoint intact and readers never see a partial one;
`prune_checkpoints` removes what a killed write left behind. Every safetensors file is written through
`save_tensors` (checkpoints here, Hugging Face and peft directories in `gptlab.interop`), whose failures are
OSErrors: the atomic write turns them into its one-line message (a full disk: what was needed, what is free).

What is saved is the plain model's weights, unwrapped from torch.compile / DDP / FSDP, a tied matrix once, and for a
LoRA run only the adapters, with their base's path and sha256. Under FSDP every process writes its own rows of each
weight and moment into the one file (`checkpoint.sharded`): nothing is gathered. Tensors sharded some other way
are gathered whole one at a time, every process taking part in each gather and only the writer keeping a copy.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from gptlab.checkpoint import sharded
from gptlab.checkpoint.layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LORA_CONFIG,
    LORA_FILE,
    LORA_FORMAT,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    TOKENIZER_FILES,
    list_step_checkpoints,
    unwrap_model,
)
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_dir
from gptlab.lora import has_lora, lora_state_dict

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer


# ------------------------------------------------------------------------------------------------------------
# Model weights
# ------------------------------------------------------------------------------------------------------------
def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """`save_file`, its failures raised as OSError with their errno: safetensors reports a full disk as
    SafetensorError("... I/O error: No space left on device (os error 28)"), which no write handler knows."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code.group(1)) if code else errno.EIO, str(e), str(path)) from None


def model_state_dict(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The weights to save: unwrapped from torch.compile / DDP, tied weights once, contiguous, on the CPU.
    FSDP-sharded weights are gathered whole: under FSDP every process must call this, and those that will not
    write pass `keep=False` (they take part in the gathers, keep nothing and get {})."""
    return _on_cpu(_model_tensors(model), keep)


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `model_state_dict` saves, as the model holds them (FSDP's DTensor shards included)."""
    model = unwrap_model(model)
    if has_lora(model):  # the base is frozen and lives elsewhere: only the adapters are the run's
        return lora_state_dict(model)
    state = model.state_dict()
    # a quantized model's Linears hold integers and no weight (found by its state: importing gptlab.quantize here
    # would cost every run's start-up)
    if any(not t.is_floating_point() for t in state.values()):
        raise GptlabError("cannot save a quantized model: checkpoints and the Hugging Face export hold "
                          "full-precision weights (save the model before quantize_model, and quantize it when "
                          "loading: load_model(..., quantize=...)); GGUF quantizes itself: --dtype q8_0 or q4_0")
    if getattr(model, "config", None) is not None and model.config.tie_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as transformer.wte.weight
    return state


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor in full: an FSDP shard (DTensor) gathered from every process (collective), else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _on_cpu(tensors: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Each tensor whole, contiguous, on the CPU; with `keep=False` only the gathers of shards (the collectives
    every process must enter, in the same order), each whole tensor dropped at once: {}."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if keep:
            out[name] = whole(value).detach().contiguous().cpu()
        elif hasattr(value, "full_tensor"):
            whole(value)  # gathered on the device, freed before the next one
    return out


def write_model(
    directory: Path,
    model: torch.nn.Module,
    tokenizer: TextTokenizer | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    save: Callable[[dict[str, torch.Tensor], Path, dict[str, str]], None] = save_tensors,
) -> None:
    """Write weights (`model_state_dict(model)` unless given; through `save`), config and (optionally) the tokenizer
    into an existing directory."""
    plain = unwrap_model(model)
    weights = model_state_dict(plain) if weights is None else weights
    base = getattr(plain, "lora_base", None)
    if has_lora(plain) and base is None:
        raise GptlabError("a model with LoRA adapters needs `lora_base` (its base's path and sha256) to be saved")
    save(weights, directory / weights_file(plain), {"format": "pt", "library": "gptlab"})
    if has_lora(plain):
        lora = {"format": LORA_FORMAT, "version": 1, **plain.lora_spec.to_dict(), "base": base}
        (directory / LORA_CONFIG).write_text(json.dumps(lora, indent=2) + "\n")
    (directory / CONFIG_FILE).write_text(json.dumps(plain.config.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(directory)


def weights_file(model: torch.nn.Module) -> str:
    """The file a model's weights go to: its adapters' for a LoRA model, else the whole model's."""
    return LORA_FILE if has_lora(unwrap_model(model)) else MODEL_FILE


def save_model(path: str | Path, model: torch.nn.Module, tokenizer: TextTokenizer | None = None) -> Path:
    """Save a model (and tokenizer) as a checkpoint directory, atomically."""
    if not isinstance(model, torch.nn.Module):  # else an AttributeError from deep in the state dict's reading
        swapped = " (the path comes first: save_model(path, model), unlike save_hf)" if isinstance(
            path, torch.nn.Module) else ""
        raise GptlabError(f"save_model's model must be a torch.nn.Module, got {type(model).__name__}{swapped}")
    weights = model_state_dict(model)
    return atomic_write_dir(path, lambda tmp: write_model(tmp, model, tokenizer, weights),
                            needed=sharded.global_nbytes(weights))


# ------------------------------------------------------------------------------------------------------------
# Training checkpoints: weights + optimizer state (safetensors) + trainer state (JSON)
# ------------------------------------------------------------------------------------------------------------
def optimizer_to_flat(
    optimizers: list[torch.optim.Optimizer], keep: bool = True
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimizer state as flat tensors `opt{i}.{param}.{name}`, plus JSON-able param groups and scalars. FSDP:
    sharded moments are gathered whole, so every process calls this; `keep=False` keeps no tensor ({})."""
    tensors, described = _optimizer_tensors(optimizers)
    return _on_cpu(tensors, keep), described


def _optimizer_tensors(optimizers: list[torch.optim.Optimizer]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """`optimizer_to_flat`'s tensors as the optimizers hold them (FSDP's DTensor shards included)."""
    tensors: dict[str, torch.Tensor] = {}
    described: list[dict] = []
    for i, opt in enumerate(optimizers):
        sd = opt.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for pid, state in sd["state"].items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"opt{i}.{pid}.{name}"] = value
                else:
                    scalars.setdefault(str(pid), {})[name] = value
        described.append({"type": type(opt).__name__, "param_groups": sd["param_groups"], "scalars": scalars})
    return tensors, described


def save_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    state: dict[str, Any],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    tokenizer_dir: str | Path | None = None,
    writer: bool = True,
) -> Path | None:
    """Write a training checkpoint atomically: model.safetensors, config.json, state.json (`state`), the
    tokenizer files copied from `tokenizer_dir` (the data directory) and, when there are optimizers,
    optimizer.safetensors with their state in state.json (a resumable checkpoint).

    Under FSDP every process calls this and writes its rows of each file (`checkpoint.sharded`); the `writer`
    writes the rest. Returns the checkpoint's path on the writer, None elsewhere."""
    weights = _model_tensors(model)
    tensors, described = _optimizer_tensors(list(optimizers))
    if optimizers:
        state = {**state, "optimizers": described}

    def write_rest(tmp: Path) -> None:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
        for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)

    needed = sharded.global_nbytes(weights) + sharded.global_nbytes(tensors)
    if sharded.applies(weights, tensors):
        def lay_out(tmp: Path) -> None:
            write_model(tmp, model, weights=weights, save=sharded.create)
            if optimizers:
                sharded.create(tensors, tmp / OPTIMIZER_FILE, {"library": "gptlab"})
            write_rest(tmp)

        def files(tmp: Path) -> dict[Path, dict[str, torch.Tensor]]:
            return {tmp / weights_file(model): weights, **({tmp / OPTIMIZER_FILE: tensors} if optimizers else {})}

        return sharded.save_in_rows(
            lambda write: atomic_write_dir(directory, write, needed=needed, replace_unmarked=True),
            lay_out, files, writer)

    weights, tensors = _on_cpu(weights, writer), _on_cpu(tensors, writer)
    if not writer:
        return None

    def write(tmp: Path) -> None:
        write_model(tmp, model, weights=weights)
        if optimizers:
            save_tensors(tensors, tmp / OPTIMIZER_FILE, {"library": "gptlab"})
        write_rest(tmp)

    return atomic_write_dir(directory, write, needed=needed, replace_unmarked=True)


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints, and leftovers of interrupted writes."""
    for old in list_step_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    root = Path(run_dir) / CHECKPOINTS_DIR
    leftovers = [*root.glob(".*.tmp-*"), *root.glob(".*.old-*")] if root.is_dir() else []
    for tmp in leftovers:  # a kill mid-write; the run directory's lock says no other run is writing them
        shutil.rmtree(tmp, ignore_errors=True)
