"""Reading checkpoints back, checked: one-line errors naming the damaged file (`read_tensors`, `read_config`,
`read_training_state`, `read_lora_config`), and the one rule for loading weights.

The rule (`load_weights`): a checkpoint holds exactly the tensors of the plain GPT its config describes. A model
with modules added on top (adapters) takes it only when the caller says to keep those extra tensors as they are.
A LoRA run's checkpoint holds only the adapters (`load_adapter_tensors`), checked against the model's, and the
sha256 of the base they belong to (`weights_sha256`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from gptlab.checkpoint.layout import (
    CONFIG_FILE,
    LORA_CONFIG,
    LORA_FILE,
    LORA_FORMAT,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SAFETENSORS_DTYPES,
    STATE_FILE,
    unwrap_model,
)
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import read_json_object, safetensors_problem
from gptlab.lora import LoRASpec, has_lora, lora_state_dict
from gptlab.model import GPT


# ------------------------------------------------------------------------------------------------------------
# Model weights
# ------------------------------------------------------------------------------------------------------------
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
    check_plain_shapes(expected, {name: tuple(t.shape) for name, t in state.items()}, where)
    check_floating(state, where)
    extra = sorted(set(model.state_dict()) - set(expected))
    if extra and not keep_extra:
        raise GptlabError(f"the model has tensors a plain GPT checkpoint cannot fill ({extra[0]!r}"
                          f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}); keep them explicitly "
                          "(keep_extra=True) or load into a plain GPT")
    model.load_state_dict(state, strict=False, assign=assign)
    if assign and model.config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced the shared Parameter: re-tie
    return extra


def check_plain_shapes(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], where: str
                       ) -> None:
    """One-line errors for tensors (`shapes`, the head's name included when tied) that are not exactly those of
    the plain GPT (`expected`, from `plain_shapes`): one missing, one the model has no place for, a wrong shape."""
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise GptlabError(f"{where} lacks the weight {missing[0]!r}" + (f" and {len(missing) - 1} more"
                                                                         if len(missing) > 1 else ""))
    unknown = sorted(set(shapes) - set(expected))
    if unknown:
        raise GptlabError(f"{where} has a weight the model has no place for: {unknown[0]!r}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise GptlabError(f"{where}: {name} has shape {tuple(shapes[name])}, the model's config implies {shape}")


def check_floating(state: dict[str, torch.Tensor], where: str) -> None:
    """Weights are floating point: an integer tensor (a quantized or damaged file) would be cast to other numbers,
    or fail in torch's load_state_dict with a page of text."""
    for name, t in state.items():
        if not t.is_floating_point():
            raise GptlabError(f"{where}: {name} holds {str(t.dtype).removeprefix('torch.')} values, not "
                              "floating-point weights")


def stream_tensors(path: Path) -> tuple[dict[str, tuple[int, ...]], Iterator[tuple[str, torch.Tensor]]]:
    """(every tensor's shape, from the header; an iterator over (name, tensor) in the file's order), each tensor
    read through a mapping of the file of its own, closed before the next: the pages a mapping has touched count
    as the process's memory while it is open, so the file is never resident whole, only its largest tensor."""
    problem = safetensors_problem(path)
    if problem:
        raise GptlabError(problem)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (OSError, SafetensorError) as e:
        raise GptlabError(f"{path} cannot be read: {e}") from None

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key in shapes:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    tensor = f.get_tensor(key)
            except (OSError, SafetensorError) as e:
                raise GptlabError(f"{path} cannot be read: {e}") from None
            yield key, tensor

    return shapes, tensors()


def assign_weights(model: GPT, state: dict[str, torch.Tensor], where: str = "the checkpoint") -> GPT:
    """Make `state`'s tensors the parameters of a plain GPT built on the meta device (no init, no copy)."""
    load_weights(model, state, assign=True, where=where)
    return model.eval()


def read_tensors(
    path: Path, device: str | torch.device = "cpu", shards: Callable[[str], torch.Tensor | None] | None = None
) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a one-line GptlabError naming the file if it is missing or damaged.

    `shards(key)`: the tensor a key will be loaded into, where that is an FSDP shard (a DTensor) of the same whole
    shape, else None. Such a key is read as this process's rows alone (a slice of the file, never the whole tensor)
    and comes back as a DTensor sharded like its target: resuming under FSDP holds 1/world of every weight and
    moment per process, not all of them."""
    problem = safetensors_problem(path)
    if problem:
        raise GptlabError(problem)
    try:
        if shards is None:
            return load_file(str(path), device=str(device))
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = {}
            for key in f.keys():
                target = shards(key)
                part = f.get_slice(key)
                if hasattr(target, "device_mesh") and tuple(part.get_shape()) == tuple(target.shape):
                    out[key] = _local_part(part, target)
                else:
                    out[key] = f.get_tensor(key).to(device)
            return out
    except (OSError, SafetensorError) as e:
        raise GptlabError(f"{path} cannot be read: {e}") from None


def _local_part(part: Any, target: torch.Tensor) -> torch.Tensor:
    """This process's block of a file's tensor, as a DTensor laid out like `target` (read as a slice)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if 0 in shape:  # more processes than rows: this one holds none
        local = torch.empty(shape, dtype=SAFETENSORS_DTYPES[part.get_dtype()])
    else:
        local = part[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return DTensor.from_local(local.to(target.device), target.device_mesh, target.placements, run_check=False,
                              shape=target.shape, stride=target.stride())


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
# Training checkpoints: weights + optimizer state (safetensors) + trainer state (JSON)
# ------------------------------------------------------------------------------------------------------------
def _moment_targets(optimizers: list[torch.optim.Optimizer]) -> Callable[[str], torch.Tensor | None]:
    """For an optimizer file's key ("opt{i}.{param}.{name}"), the parameter its state goes with."""
    params = [[p for group in opt.param_groups for p in group["params"]] for opt in optimizers]

    def target(key: str) -> torch.Tensor | None:
        parts = key.split(".", 2)
        if len(parts) != 3 or not parts[0].startswith("opt") or not parts[0][3:].isdigit() or not parts[1].isdigit():
            return None
        i, pid = int(parts[0][3:]), int(parts[1])
        return params[i][pid] if i < len(params) and pid < len(params[i]) else None

    return target


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
        for pid, values in desc["scalars"].items():
            state.setdefault(int(pid), {}).update(values)
        # JSON turned tuples (betas, ns_coefficients) into lists: turn them back, all but the param ids
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                  for g in desc["param_groups"]]
        opt.load_state_dict({"state": state, "param_groups": groups})


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
    # FSDP: each process reads its own rows of the sharded tensors (and of the moments, below)
    if adapters_only:
        weights = load_adapter_tensors(directory, plain, shards=current.get)
    else:
        weights = read_tensors(directory / MODEL_FILE, shards=current.get)
    with torch.no_grad():  # copies into the existing parameters: optimizers stay valid
        if adapters_only:
            plain.load_state_dict(weights, strict=False)
        else:
            load_weights(plain, weights, where=f"{directory / MODEL_FILE} (the run's model)")
    state = read_training_state(directory)
    device = next(plain.parameters()).device
    tensors = read_tensors(directory / OPTIMIZER_FILE, device, shards=_moment_targets(optimizers))
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
    base = meta.get("base")
    if not (isinstance(base, dict) and isinstance(base.get("path"), str) and isinstance(base.get("sha256"), str)):
        raise GptlabError(f"{path}: \"base\" must be an object of the base model's \"path\" and \"sha256\" "
                          f"(strings), got {str(base)[:80]!r}")
    try:
        spec = LoRASpec.from_dict(meta)
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: an infinite rank
        what = f"the key {e}" if isinstance(e, KeyError) else str(e)
        raise GptlabError(f"{path} lacks or garbles {what}: the adapters cannot be placed") from None
    base = {"path": base["path"], "sha256": base["sha256"]}
    # JSON allows NaN and any integer: a NaN alpha samples garbage, a huge rank allocates gigabytes
    if isinstance(meta["rank"], bool) or not isinstance(meta["rank"], int) or spec.rank < 1:
        raise GptlabError(f"{path}: rank must be a whole number of at least 1, got {meta['rank']!r}")
    if not (math.isfinite(spec.alpha) and spec.alpha > 0):
        raise GptlabError(f"{path}: alpha must be a finite number above 0, got {meta['alpha']!r}")
    if not (math.isfinite(spec.dropout) and 0 <= spec.dropout < 1):
        raise GptlabError(f"{path}: dropout must be in [0, 1), got {meta['dropout']!r}")
    return spec, base


def load_adapter_tensors(
    directory: str | Path, model: torch.nn.Module, shards: Callable[[str], torch.Tensor | None] | None = None
) -> dict[str, torch.Tensor]:
    """lora.safetensors, checked to hold exactly `model`'s adapter tensors with their shapes (`shards`: as
    `read_tensors` takes it)."""
    directory = Path(directory)
    path = directory / LORA_FILE
    tensors = read_tensors(path, shards=shards)
    expected = {k: tuple(v.shape) for k, v in lora_state_dict(unwrap_model(model)).items()}
    for name, shape in expected.items():
        if name not in tensors:
            raise GptlabError(f"{path} lacks the adapter {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise GptlabError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise GptlabError(f"{path} has an adapter this model has no place for: {unknown[0]!r}")
    check_floating(tensors, str(path))
    return tensors
