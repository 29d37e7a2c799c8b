"""Safe checkpoints: safetensors for tensors, JSON for everything else, written atomically. Never pickle.

A checkpoint is a directory:

    model.safetensors   the weights (tied weights stored once, no `_orig_mod.` prefixes)
    config.json         the GPTConfig
    lora.safetensors    (instead of model.safetensors, a LoRA run's checkpoints) only the adapters, fp32
    lora.json           with it: {"format": "gptlab-lora", "version", rank, alpha, dropout, targets,
                        "base": {"path", "sha256"}}: the frozen base the adapters belong to, and the sha256 of its
                        weight files, checked whenever the adapters are put back on it
    tokenizer files     whatever `Tokenizer.save` writes (optional)
    optimizer.safetensors  (training checkpoints) every optimizer's state tensors, flat: `opt{i}.{param}.{name}`
    state.json          (training checkpoints) step, elapsed_sec, best_val_loss, tokens_seen, the torch RNG
                        states (base64), config + config_hash, data_dir, and each optimizer's type, param groups
                        (hyper-parameters, peak_lr) and non-tensor state

A run directory (`gptlab train --out`) holds:

    .lock                         held (flock) by the `gptlab train` writing the run; holds its pid
    config.resolved.json          the training config, the model config, data dir, world size, device
    metrics.jsonl                 one JSON object per logged step (train_loss, lr, tokens_per_sec, mfu, val_loss)
    checkpoints/step-NNNNNNN/     the last `keep_last` training checkpoints
    checkpoints/best/             the best validation loss so far: weights, config, tokenizer, state.json

Writes go through a temporary directory swapped into place (`gptlab.fileio`, which also leaves its `.gptlab`
marker in each), so a crash leaves the previous checkpoint intact and readers never see a partial one (temporary
`.step-*.tmp-*` directories are skipped and pruned). Reads name the damaged file in one line (`read_tensors`,
`read_config`, `read_training_state`). Which directory a path means (a run, a checkpoint, a Hugging Face
directory) is `gptlab.loading`'s job.

Loading follows one explicit rule (`load_weights`): a checkpoint holds exactly the tensors of the plain GPT its
config describes. A model with modules added on top (adapters) takes it only when the caller says to keep those
extra tensors as they are.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_dir, read_json_object, safetensors_problem
from gptlab.lora import LoRASpec, has_lora, lora_state_dict
from gptlab.model import GPT

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CHECKPOINTS_DIR = "checkpoints"
BEST_NAME = "best"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
TOKENIZER_FILES = ("tokenizer_meta.json", "tokenizer.json")
LORA_FILE = "lora.safetensors"
LORA_CONFIG = "lora.json"
LORA_FORMAT = "gptlab-lora"
STEP_NAME = re.compile(r"step-\d+")  # a step checkpoint (a copy moved aside, e.g. damaged-step-N, is not)


def has_weights(directory: Path) -> bool:
    """Whether a directory holds gptlab weights: a whole model, or a LoRA run's adapters."""
    return (directory / MODEL_FILE).is_file() or (directory / LORA_FILE).is_file()


# ------------------------------------------------------------------------------------------------------------
# Model weights
# ------------------------------------------------------------------------------------------------------------
def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to save: unwrapped from torch.compile / DDP, tied weights once, contiguous, on the CPU.
    FSDP-sharded weights are gathered whole: under FSDP every process must call this."""
    model = unwrap_model(model)
    if has_lora(model):  # the base is frozen and lives elsewhere: only the adapters are the run's
        return {k: whole(v).detach().contiguous().cpu() for k, v in lora_state_dict(model).items()}
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
    weights = model_state_dict(plain) if weights is None else weights
    if has_lora(plain):
        base = getattr(plain, "lora_base", None)
        if base is None:
            raise GptlabError("a model with LoRA adapters needs `lora_base` (its base's path and sha256) to be saved")
        save_file(weights, str(directory / LORA_FILE), metadata=metadata)
        lora = {"format": LORA_FORMAT, "version": 1, **plain.lora_spec.to_dict(), "base": base}
        (directory / LORA_CONFIG).write_text(json.dumps(lora, indent=2) + "\n")
    else:
        save_file(weights, str(directory / MODEL_FILE), metadata=metadata)
    (directory / CONFIG_FILE).write_text(json.dumps(plain.config.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(directory)


def save_model(path: str | Path, model: torch.nn.Module, tokenizer: Any = None) -> Path:
    """Save a model (and tokenizer) as a checkpoint directory, atomically."""
    return atomic_write_dir(path, lambda tmp: write_model(tmp, model, tokenizer))


def with_tied_head(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A saved tied matrix is stored once; `load_state_dict` wants it under the head's name too."""
    if config.tie_embeddings and "transformer.wte.weight" in state:
        state.setdefault("lm_head.weight", state["transformer.wte.weight"])
    return state


def plain_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the plain GPT that `config` describes, with its shape (built on the meta device: free)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPT(config).state_dict().items()}


def load_weights(
    model: GPT, state: dict[str, torch.Tensor], *, keep_extra: bool = False, assign: bool = False,
    where: str = "the checkpoint",
) -> list[str]:
    """Put a checkpoint's tensors into `model`; returns the names of the model's tensors it left alone.

    The rule: `state` holds exactly the tensors of the plain GPT that `model.config` describes (a tied head may
    be stored once), each of the right shape. A model with more tensors than that (modules added on top, such
    as adapters) is refused unless `keep_extra=True`, in which case those tensors keep their current values.
    `assign=True` makes `state`'s tensors the parameters themselves (for a model built on the meta device)
    instead of copying into the existing ones.
    """
    expected = plain_shapes(model.config)
    state = with_tied_head(dict(state), model.config)
    missing = [name for name in expected if name not in state]
    if missing:
        raise GptlabError(f"{where} lacks the weight {missing[0]!r}" + (f" and {len(missing) - 1} more"
                                                                         if len(missing) > 1 else ""))
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise GptlabError(f"{where} has a weight the model has no place for: {unknown[0]!r}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise GptlabError(f"{where}: {name} has shape {tuple(state[name].shape)}, the model's config "
                              f"implies {shape}")
    extra = sorted(set(model.state_dict()) - set(expected))
    if extra and not keep_extra:
        raise GptlabError(f"the model has tensors a plain GPT checkpoint cannot fill ({extra[0]!r}"
                          f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}); keep them explicitly "
                          "(keep_extra=True) or load into a plain GPT")
    model.load_state_dict(state, strict=False, assign=assign)
    if assign and model.config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced the shared Parameter: re-tie
    return extra


def assign_weights(model: GPT, state: dict[str, torch.Tensor], where: str = "the checkpoint") -> GPT:
    """Make `state`'s tensors the parameters of a plain GPT built on the meta device (no init, no copy)."""
    load_weights(model, state, assign=True, where=where)
    return model.eval()


def read_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a one-line GptlabError naming the file if it is missing or damaged."""
    problem = safetensors_problem(path)
    if problem:
        raise GptlabError(problem)
    try:
        return load_file(str(path), device=str(device))
    except (OSError, SafetensorError) as e:
        raise GptlabError(f"{path} cannot be read: {e}") from None


def read_config(path: Path) -> GPTConfig:
    """A checkpoint's config.json; a one-line GptlabError naming the file when a field is missing or wrong."""
    try:
        return GPTConfig.load(path)
    except (ValueError, TypeError, KeyError) as e:
        raise GptlabError(f"{path}: {' '.join(str(e).split())}") from None


def load_gptlab_model(
    directory: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> GPT:
    config = read_config(directory / CONFIG_FILE)
    with torch.device("meta"):
        model = GPT(config)
    where = f"{directory / MODEL_FILE} (against {directory / CONFIG_FILE})"
    assign_weights(model, read_tensors(directory / MODEL_FILE, device), where=where)
    model.to(device=device, dtype=dtype)
    return model.eval()


# ------------------------------------------------------------------------------------------------------------
# A run directory's checkpoints
# ------------------------------------------------------------------------------------------------------------
def list_step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints, oldest first (complete ones only: temporary directories are skipped)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if STEP_NAME.fullmatch(p.name) and has_weights(p)]
    return sorted(steps, key=lambda p: int(p.name.split("-", 1)[1]))


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints, and leftovers of interrupted writes."""
    for old in list_step_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    root = Path(run_dir) / CHECKPOINTS_DIR
    leftovers = [*root.glob(".*.tmp-*"), *root.glob(".*.old-*")] if root.is_dir() else []
    for tmp in leftovers:  # a kill mid-write; the run directory's lock says no other run is writing them
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------------
# Training checkpoints: weights + optimizer state (safetensors) + trainer state (JSON)
# ------------------------------------------------------------------------------------------------------------
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

    Under FSDP every process calls this (the shards are gathered) and only the `writer` writes."""
    weights = model_state_dict(model)
    tensors, described = optimizer_to_flat(list(optimizers))
    if not writer:
        return None
    if optimizers:
        state = {**state, "optimizers": described}

    def write(tmp: Path) -> None:
        write_model(tmp, model, weights=weights)
        if optimizers:
            save_file(tensors, str(tmp / OPTIMIZER_FILE), metadata={"library": "gptlab"})
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
        for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)

    needed = sum(t.nbytes for t in (*weights.values(), *tensors.values()))
    return atomic_write_dir(directory, write, needed=needed, replace_unmarked=True)


def read_training_state(directory: Path, required: dict[str, Any] | None = None) -> dict[str, Any]:
    """state.json of a resumable checkpoint, with the `required` keys (key -> type or tuple of types; by default
    only the optimizers') checked (one line naming the file)."""
    path = Path(directory) / STATE_FILE
    state = read_json_object(path)
    for key, types in (required or {"optimizers": list}).items():
        if key not in state:
            raise GptlabError(f"{path} lacks the key {key!r}")
        if not isinstance(state[key], types) or isinstance(state[key], bool):
            raise GptlabError(f"{path}: {key} has the wrong type ({type(state[key]).__name__}: "
                              f"{str(state[key])[:40]!r})")
    return state


def load_training_checkpoint(
    directory: str | Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Load weights into `model` and state into `optimizers`, in place; returns state.json's trainer state."""
    directory = Path(directory)
    plain = unwrap_model(model)
    current = plain.state_dict()
    adapters_only = has_lora(plain)  # a LoRA run's checkpoint holds the adapters, not the frozen base
    if adapters_only:
        weights = load_adapter_tensors(directory, plain)
    else:
        weights = read_tensors(directory / MODEL_FILE)
    weights = {k: shard_like(v, current[k]) if k in current else v for k, v in weights.items()}  # FSDP: shard them
    with torch.no_grad():  # copies into the existing parameters: optimizers stay valid
        if adapters_only:
            plain.load_state_dict(weights, strict=False)
        else:
            load_weights(plain, weights, where=f"{directory / MODEL_FILE} (the run's model)")
    state = read_training_state(directory)
    device = next(plain.parameters()).device
    tensors = read_tensors(directory / OPTIMIZER_FILE, device)
    try:
        optimizer_from_flat(optimizers, tensors, state.pop("optimizers"))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise GptlabError(f"{directory / OPTIMIZER_FILE} does not fit this run's optimizers: "
                          f"{' '.join(str(e).split())[:200]}") from None
    return state


# ------------------------------------------------------------------------------------------------------------
# LoRA checkpoints: the adapters, and which base they belong to
# ------------------------------------------------------------------------------------------------------------
def weights_sha256(directory: str | Path) -> str:
    """One sha256 over a model directory's weight files (*.safetensors, by name): a base's fingerprint."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise GptlabError(f"{directory} has no .safetensors weights to fingerprint")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def read_lora_config(directory: str | Path) -> tuple[LoRASpec, dict[str, str]]:
    """lora.json of a LoRA checkpoint: the adapters' spec and their base ({"path", "sha256"})."""
    path = Path(directory) / LORA_CONFIG
    meta = read_json_object(path)
    if meta.get("format") != LORA_FORMAT:
        raise GptlabError(f"{path} is not a gptlab LoRA config (format {meta.get('format')!r})")
    try:
        spec = LoRASpec.from_dict(meta)
        base = {"path": str(meta["base"]["path"]), "sha256": str(meta["base"]["sha256"])}
    except (KeyError, TypeError, ValueError) as e:
        raise GptlabError(f"{path} lacks or garbles {e}: the adapters cannot be placed") from None
    return spec, base


def load_adapter_tensors(directory: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """lora.safetensors, checked to hold exactly `model`'s adapter tensors with their shapes."""
    directory = Path(directory)
    path = directory / LORA_FILE
    tensors = read_tensors(path)
    expected = {k: tuple(v.shape) for k, v in lora_state_dict(unwrap_model(model)).items()}
    for name, shape in expected.items():
        if name not in tensors:
            raise GptlabError(f"{path} lacks the adapter {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise GptlabError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise GptlabError(f"{path} has an adapter this model has no place for: {unknown[0]!r}")
    return tensors
