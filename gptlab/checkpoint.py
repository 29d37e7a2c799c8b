"""Safe checkpoints: safetensors for tensors, JSON for everything else, written atomically. Never pickle.

A checkpoint is a directory:

    model.safetensors   the weights (tied weights stored once, no `_orig_mod.` prefixes)
    config.json         the GPTConfig
    tokenizer files     whatever `Tokenizer.save` writes (optional)
    optimizer.safetensors  (training checkpoints) every optimizer's state tensors, flat: `opt{i}.{param}.{name}`
    state.json          (training checkpoints) step, elapsed_sec, best_val_loss, tokens_seen, the torch RNG
                        states (base64), config + config_hash, data_dir, and each optimizer's type, param groups
                        (hyper-parameters, peak_lr) and non-tensor state

A run directory (`gptlab train --out`) holds:

    config.resolved.json          the training config, the model config, data dir, world size, device
    metrics.jsonl                 one JSON object per logged step (train_loss, lr, tokens_per_sec, mfu, val_loss)
    checkpoints/step-NNNNNNN/     the last `keep_last` training checkpoints
    checkpoints/best/             the best validation loss so far: weights, config, tokenizer, state.json

`resolve_checkpoint` turns a run, a checkpoint or a Hugging Face directory into something loadable. Writes go
through a temporary directory renamed into place, so a crash leaves the previous checkpoint intact and readers
never see a partial one (temporary `.step-*.tmp-*` directories are skipped and pruned).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.model import GPT

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CHECKPOINTS_DIR = "checkpoints"
BEST_NAME = "best"


# ------------------------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (no-op where directories can't be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_dir(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Fill a fresh temporary directory with `write(tmp)`, fsync every file, then rename it to `target`.

    A crash at any point leaves either the previous `target` or the new one, never a half-written one.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if target.exists():  # replace: move the old one aside first so the rename itself is atomic
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file through a temporary file, fsync and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------------------------
# Model weights
# ------------------------------------------------------------------------------------------------------------
def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to save: unwrapped from torch.compile / DDP, tied weights once, contiguous, on the CPU.
    FSDP-sharded weights are gathered whole: under FSDP every process must call this."""
    model = unwrap_model(model)
    state = model.state_dict()
    if getattr(model, "config", None) is not None and model.config.tie_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as transformer.wte.weight
    return {k: whole(v).detach().contiguous().cpu() for k, v in state.items()}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor in full: an FSDP shard (DTensor) gathered from every process (collective), else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A whole tensor shaped like `target`: sharded the same way if target is an FSDP shard (DTensor)."""
    if hasattr(target, "device_mesh") and not hasattr(value, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(target.device), target.device_mesh, target.placements)
    return value


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain GPT under torch.compile's OptimizedModule and DDP/FSDP wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model


def write_model(
    directory: Path, model: torch.nn.Module, tokenizer: Any = None, weights: dict[str, torch.Tensor] | None = None
) -> None:
    """Write weights (`model_state_dict(model)` unless given), config and (optionally) the tokenizer into an
    existing directory."""
    plain = unwrap_model(model)
    metadata = {"format": "pt", "library": "gptlab"}
    save_file(model_state_dict(plain) if weights is None else weights, str(directory / MODEL_FILE), metadata=metadata)
    (directory / CONFIG_FILE).write_text(json.dumps(plain.config.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(directory)


def save_model(path: str | Path, model: torch.nn.Module, tokenizer: Any = None) -> Path:
    """Save a model (and tokenizer) as a checkpoint directory, atomically."""
    return atomic_write_dir(path, lambda tmp: write_model(tmp, model, tokenizer))


def with_tied_head(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A saved tied matrix is stored once; `load_state_dict` wants it under the head's name too."""
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state["transformer.wte.weight"])
    return state


def assign_weights(model: GPT, state: dict[str, torch.Tensor]) -> GPT:
    """Make `state`'s tensors the parameters of a GPT built on the meta device (no init, no copy)."""
    model.load_state_dict(with_tied_head(state, model.config), strict=True, assign=True)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced the shared Parameter: re-tie
    return model.eval()


def load_gptlab_model(
    directory: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> GPT:
    config = GPTConfig.load(directory / CONFIG_FILE)
    with torch.device("meta"):
        model = GPT(config)
    assign_weights(model, load_file(str(directory / MODEL_FILE), device=str(device)))
    model.to(device=device, dtype=dtype)
    return model.eval()


# ------------------------------------------------------------------------------------------------------------
# Finding checkpoints
# ------------------------------------------------------------------------------------------------------------
def is_hf_dir(path: Path) -> bool:
    cfg = path / CONFIG_FILE
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return False


def list_step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints, oldest first (complete ones only: temporary directories are skipped)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.name.startswith("step-") and (p / MODEL_FILE).is_file()]
    return sorted(steps, key=lambda p: int(p.name.split("-", 1)[1]))


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint directory (or Hugging Face directory) from a run, checkpoint or HF path.

    For a run directory, `prefer="best"` picks the best-validation checkpoint when there is one, else the
    latest; `prefer="latest"` picks the latest step.
    """
    path = Path(path)
    if not path.exists():
        raise GptlabError(f"{path} does not exist: pass a run directory, a checkpoint directory or a "
                          "Hugging Face one")
    if path.is_file():
        if path.name == MODEL_FILE:
            return path.parent
        raise GptlabError(f"{path} is a file: pass the directory that holds {MODEL_FILE} and {CONFIG_FILE}")
    if (path / MODEL_FILE).is_file() and (path / CONFIG_FILE).is_file() or is_hf_dir(path):
        return path
    best = path / CHECKPOINTS_DIR / BEST_NAME
    steps = list_step_checkpoints(path)
    if prefer == "best" and (best / MODEL_FILE).is_file():
        return best
    if steps:
        return steps[-1]
    if (best / MODEL_FILE).is_file():
        return best
    raise GptlabError(f"no checkpoint found in {path}: expected {MODEL_FILE} + {CONFIG_FILE}, a run "
                      f"directory with {CHECKPOINTS_DIR}/step-*/, or a Hugging Face model directory")


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    prefer: str = "best",
) -> tuple[GPT, Any]:
    """Load (model, tokenizer) from a run, checkpoint or Hugging Face directory (tokenizer: None if none)."""
    directory = resolve_checkpoint(path, prefer=prefer)
    if is_hf_dir(directory):
        from gptlab.interop import from_hf

        model = from_hf(directory, device=device, dtype=dtype)
    else:
        model = load_gptlab_model(directory, device=device, dtype=dtype)
    return model, _try_load_tokenizer(directory)


def _try_load_tokenizer(directory: Path) -> Any:
    from gptlab.tokenizer import load_tokenizer

    try:
        return load_tokenizer(directory)
    except GptlabError:
        return None


# ------------------------------------------------------------------------------------------------------------
# Training checkpoints: weights + optimizer state (safetensors) + trainer state (JSON)
# ------------------------------------------------------------------------------------------------------------
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
TOKENIZER_FILES = ("tokenizer_meta.json", "tokenizer.json")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def optimizer_to_flat(optimizers: list[torch.optim.Optimizer]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimizer state as flat tensors `opt{i}.{param}.{name}`, plus JSON-able param groups and scalars."""
    tensors: dict[str, torch.Tensor] = {}
    described: list[dict] = []
    for i, opt in enumerate(optimizers):
        sd = opt.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for pid, state in sd["state"].items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):  # FSDP: gathered whole, so every process calls this
                    tensors[f"opt{i}.{pid}.{name}"] = whole(value).detach().contiguous().cpu()
                else:
                    scalars.setdefault(str(pid), {})[name] = value
        described.append({"type": type(opt).__name__, "param_groups": sd["param_groups"], "scalars": scalars})
    return tensors, described


def optimizer_from_flat(
    optimizers: list[torch.optim.Optimizer], tensors: dict[str, torch.Tensor], described: list[dict]
) -> None:
    """Inverse of `optimizer_to_flat`: load the saved state into freshly built optimizers."""
    if len(described) != len(optimizers):
        raise GptlabError(
            f"the checkpoint has {len(described)} optimizer(s), this run builds {len(optimizers)}"
        )
    for i, (opt, desc) in enumerate(zip(optimizers, described, strict=True)):
        if desc["type"] != type(opt).__name__:
            raise GptlabError(
                f"the checkpoint's optimizer {i} is {desc['type']}, this run uses {type(opt).__name__}"
            )
        state: dict[int, dict[str, Any]] = {}
        prefix = f"opt{i}."
        for key, value in tensors.items():
            if key.startswith(prefix):
                pid, name = key[len(prefix) :].split(".", 1)
                state.setdefault(int(pid), {})[name] = value
        params = [p for group in opt.param_groups for p in group["params"]]
        for pid, values in state.items():  # FSDP: sharded like their parameter
            for name, value in values.items():
                if pid < len(params) and value.shape == params[pid].shape:
                    values[name] = shard_like(value, params[pid])
        for pid, values in desc["scalars"].items():
            state.setdefault(int(pid), {}).update(values)
        # JSON turned tuples (betas, ns_coefficients) into lists: turn them back, all but the param ids
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                  for g in desc["param_groups"]]
        opt.load_state_dict({"state": state, "param_groups": groups})


def save_training_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    state: dict[str, Any],
    tokenizer_dir: str | Path | None = None,
    writer: bool = True,
) -> Path | None:
    """Write a resumable checkpoint atomically: model.safetensors, config.json, optimizer.safetensors,
    state.json and the tokenizer files copied from `tokenizer_dir` (the data directory).

    Under FSDP every process calls this (the shards are gathered) and only the `writer` writes."""
    weights = model_state_dict(model)
    tensors, described = optimizer_to_flat(optimizers)
    if not writer:
        return None

    def write(tmp: Path) -> None:
        write_model(tmp, model, weights=weights)
        save_file(tensors, str(tmp / OPTIMIZER_FILE), metadata={"library": "gptlab"})
        (tmp / STATE_FILE).write_text(json.dumps({**state, "optimizers": described}, indent=1) + "\n")
        for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)

    return atomic_write_dir(directory, write)


def load_training_checkpoint(
    directory: str | Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Load weights into `model` and state into `optimizers`, in place; returns state.json's trainer state."""
    directory = Path(directory)
    plain = unwrap_model(model)
    weights = with_tied_head(load_file(str(directory / MODEL_FILE)), plain.config)
    current = plain.state_dict()
    weights = {k: shard_like(v, current[k]) if k in current else v for k, v in weights.items()}  # FSDP: shard them
    with torch.no_grad():
        plain.load_state_dict(
            weights, strict=True
        )  # copies into the existing parameters: optimizers stay valid
    state = json.loads((directory / STATE_FILE).read_text())
    device = next(plain.parameters()).device
    tensors = load_file(str(directory / OPTIMIZER_FILE), device=str(device))
    optimizer_from_flat(optimizers, tensors, state.pop("optimizers"))
    return state


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints, and leftovers of interrupted writes."""
    for old in list_step_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    root = Path(run_dir) / CHECKPOINTS_DIR
    for tmp in root.glob(".*.tmp-*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)
