"""Shared pieces of the Hugging Face bridge: reading config.json and weight files, RoPE settings in both
config schemas, and `Rule`s, the two-way map between one gptlab tensor and the Hugging Face tensor(s) it is
made of.

Nothing here imports `transformers`: a Hugging Face directory is just JSON plus safetensors (or torch .bin
files, which are read with `weights_only=True`, never unpickled).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from gptlab.config import GPTConfig, RopeScaling
from gptlab.errors import GptlabError
from gptlab.fileio import parse_json, read_json_object
from gptlab.rope import inv_frequencies, longrope_mscale, yarn_mscale

# GPTConfig fields every family writes, or that change nothing in a family that lacks them (rope_base under
# learned positions, gelu_approximate under SwiGLU). Every other field is a switch: a family exports a config only
# if it lists the switch's value in its EXPRESSES, or the switch is at GPTConfig's default. So a switch added to
# GPTConfig later is refused by every family until one says it can express it.
CARRIED = frozenset({
    "vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "norm_eps", "mlp_hidden", "mlp_ratio",
    "mlp_multiple", "dropout", "init_std", "name", "attention", "rope_base", "rotary_fraction", "gelu_approximate",
    "tie_embeddings", "hf_architecture", "scale_residual_init",
})

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

_MISSING = object()


# ------------------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------------------
def read_hf_config(directory: Path) -> dict[str, Any]:
    return read_json_object(directory / "config.json", hint="a Hugging Face model directory needs config.json")


def hf_value(config: dict[str, Any], *keys: str, default: Any = _MISSING) -> Any:
    """The first of `keys` that config.json sets (to something other than null); `default` if none does,
    else a one-line error naming the first key."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is _MISSING:
        raise GptlabError(f"config.json has no {keys[0]!r}, which a {config.get('model_type')} model needs")
    return default


def hf_key(config: dict[str, Any], key: str, absent: Any) -> Any:
    """config.json's value for `key` with a null kept as None (a switch turned off), or `absent` where the file
    leaves the key out: transformers' default for it, which may be on (Gemma 2's soft-caps, Mistral's window)."""
    return config[key] if key in config else absent


def hf_flag(config: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false switch of config.json: JSON's true or false only, since Python reads the string "false" as
    true (a head silently tied, its weights dropped)."""
    value = hf_value(config, key, default=default)
    if not isinstance(value, bool):
        raise GptlabError(f"config.json's {key!r} should be true or false, got {value!r}")
    return value


def rope_settings(config: dict[str, Any]) -> tuple[float, float | None, RopeScaling | None]:
    """(rope_theta, partial_rotary_factor or None, scaling or None) from either config schema.

    transformers 4.x writes `rope_theta` (Llama) or `rotary_emb_base` + `rotary_pct` (NeoX) at the top level
    and `rope_scaling` for the non-default variants; 5.x nests everything in `rope_parameters`. A variant gptlab
    does not implement is refused by name rather than silently run as plain RoPE.
    """
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise GptlabError(f"config.json's rope parameters should be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise GptlabError("per-layer-type rope parameters are not supported: gptlab has one RoPE for all layers")
    scaling = config.get("rope_scaling")
    # both schemas (rope_scaling added, as model cards say, to a config 5.x wrote): transformers reads rope_scaling
    # (and drops rope_parameters' theta), gptlab rope_parameters; where they disagree neither reading is safe
    for key, value in (scaling.items() if isinstance(scaling, dict) and scaling is not params else ()):
        key = "rope_type" if key == "type" else key
        if params.get(key) != value:
            raise GptlabError(f"config.json's rope_scaling and rope_parameters disagree on {key!r} ({value!r} against "
                              f"{params.get(key)!r}): keep one of them")
    merged = {**config, **params}
    theta = _rope_number(merged, "rope_theta", "rotary_emb_base", default=10000.0)
    fraction = _rope_number(merged, "partial_rotary_factor", "rotary_pct")
    return theta, fraction, _rope_scaling(params, config)


def _rope_number(params: dict[str, Any], *keys: str, default: float | None = None) -> float | None:
    """The first of `keys` set (not null), as a float, else `default`; anything but a number is refused naming its
    key (float() would take "2" and True, and its own error names no key)."""
    for key in (key for key in keys if params.get(key) is not None):
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GptlabError(f"config.json's rope parameter {key!r} should be a number, got {value!r}")
        return float(value)
    return default


# rope_type names -> gptlab's; "su" is Phi-3's first name for longrope
_ROPE_KINDS = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3", "longrope": "longrope",
               "su": "longrope"}


def _rope_scaling(params: dict[str, Any], config: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind not in _ROPE_KINDS:
        raise GptlabError(f"rope_type {kind!r} is not supported: gptlab implements default, "
                          f"{', '.join(k for k in _ROPE_KINDS if k != 'su')}")
    kind = _ROPE_KINDS[kind]
    max_pos = config.get("max_position_embeddings")
    original = hf_value({**config, **params}, "original_max_position_embeddings", default=max_pos)
    if kind == "dynamic" and max_pos is not None:  # transformers' dynamic NTK reads max_position_embeddings only
        original = max_pos
    factor = _rope_number(params, "factor")
    if factor is None and kind in ("yarn", "longrope") and original and max_pos:
        factor = max_pos / original  # transformers' rule for both when factor is absent
    if factor is None and kind != "longrope":  # transformers refuses it too; a factor of 1 would scale nothing
        raise GptlabError(f"config.json's rope parameters have rope_type {kind!r} but no 'factor', which it needs")
    fields: dict[str, Any] = {"kind": kind}
    if kind != "longrope":
        fields["factor"] = factor
    if kind != "linear":
        fields["original_context"] = original
    if kind == "yarn":
        fields.update(attention_factor=_yarn_attention_factor(params, float(factor or 1.0)),
                      beta_fast=_rope_number(params, "beta_fast") or 32.0,
                      beta_slow=_rope_number(params, "beta_slow") or 1.0, truncate=hf_flag(params, "truncate", True))
    elif kind == "llama3":
        fields.update(low_freq_factor=_rope_number(params, "low_freq_factor", default=1.0),
                      high_freq_factor=_rope_number(params, "high_freq_factor", default=4.0))
    elif kind == "longrope":
        attention = _rope_number(params, "attention_factor")
        if attention is None:  # the paper's rule, on the stretch of the context
            attention = longrope_mscale(float(factor or 1.0), original)
        fields.update(attention_factor=float(attention), short_factor=hf_value(params, "short_factor"),
                      long_factor=hf_value(params, "long_factor"))
    try:
        return RopeScaling(**fields)
    except (ValueError, TypeError) as e:
        raise GptlabError(f"config.json's rope parameters: {e}") from None


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin factor: given, or 0.1 ln(factor) + 1, or its ratio form with mscale / mscale_all_dim."""
    attention, mscale, mscale_all_dim = (_rope_number(params, key)
                                         for key in ("attention_factor", "mscale", "mscale_all_dim"))
    if attention is not None:
        return attention
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def context_from_hf(max_pos: int, scaling: RopeScaling | None) -> int:
    """gptlab's block_size for a config: max_position_embeddings, or the stretched context a scaling is for
    (transformers itself never refuses a longer input; gptlab's block_size does)."""
    if scaling is None or scaling.kind in ("linear", "longrope"):
        return max_pos
    return max(max_pos, int(scaling.original_context * scaling.factor))


def rope_to_hf(cfg: GPTConfig, partial_rotary_factor: float | None = None) -> dict[str, Any]:
    """RoPE keys for config.json in both schemas: 4.x reads the top-level rope_theta and rope_scaling, 5.x reads
    rope_parameters (and would also convert the top-level keys): writing both keeps either from guessing."""
    scaling = cfg.rope_scaling
    extra: dict[str, Any] = {}
    if scaling is not None:
        extra = {"rope_type": scaling.kind}
        if scaling.kind != "longrope":
            extra["factor"] = scaling.factor
        if scaling.original_context is not None:
            extra["original_max_position_embeddings"] = scaling.original_context
        if scaling.kind == "yarn":
            extra.update(attention_factor=rope_attention_factor(cfg), beta_fast=scaling.beta_fast,
                         beta_slow=scaling.beta_slow, truncate=scaling.truncate)
        elif scaling.kind == "llama3":
            extra.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
        elif scaling.kind == "longrope":
            extra.update(attention_factor=rope_attention_factor(cfg), short_factor=list(scaling.short_factor),
                         long_factor=list(scaling.long_factor))
    partial = {} if partial_rotary_factor is None else {"partial_rotary_factor": partial_rotary_factor}
    return {
        "rope_theta": cfg.rope_base,
        "rope_scaling": ({"type": extra["rope_type"], **extra} if extra else None),
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base, **partial, **extra},
    }


def rope_attention_factor(cfg: GPTConfig) -> float:
    """The cos/sin factor gptlab uses for a yarn or longrope config (written out so no reader recomputes it)."""
    return inv_frequencies(cfg, 1)[1]


def max_positions_to_hf(cfg: GPTConfig) -> int:
    """max_position_embeddings for config.json: block_size, except under dynamic scaling, whose threshold it is."""
    scaling = cfg.rope_scaling
    return scaling.original_context if scaling is not None and scaling.kind == "dynamic" else cfg.block_size


def attention_layers(hf: dict[str, Any], n_layer: int, window: int | None) -> tuple[int | None, int | None]:
    """(sliding_window, global_layer_every) from config.json's window and `layer_types` (5.x; absent: every layer
    slides when a window is set). gptlab expresses all layers sliding, none, or every k-th one global."""
    types = hf.get("layer_types")
    if window is None or types is None:
        return window, None
    if not isinstance(types, list) or len(types) != n_layer or \
            not set(types) <= {"sliding_attention", "full_attention"}:
        raise GptlabError(f"config.json's layer_types should list sliding_attention or full_attention for each "
                          f"of the {n_layer} layers, got {types!r}")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full:
        return window, None
    if len(full) == n_layer:
        return None, None
    every = full[0] + 1
    if every >= 2 and full == list(range(every - 1, n_layer, every)):
        return window, every
    raise GptlabError(f"layer_types {types!r} is not expressible: gptlab's sliding-window layers are all layers, "
                      "none, or all but every k-th (global_layer_every)")


def layer_types_to_hf(cfg: GPTConfig) -> list[str]:
    return ["sliding_attention" if cfg.sliding_layer(i) else "full_attention" for i in range(cfg.n_layer)]


class _Any:
    """EXPRESSES' value for a switch a family takes at any value (head_dim, sliding_window)."""

    def __contains__(self, value: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()


def unsupported_export(family: str, switch: str, why: str) -> GptlabError:
    """The error of a family that fits a config's switches but not a relation between them."""
    return GptlabError(f"cannot export to Hugging Face: {switch} has no equivalent in {family} ({why})")


def check_multi_head(cfg: GPTConfig, family: str) -> None:
    """For families without grouped-query attention (GPT-2, GPT-NeoX, GPT-J)."""
    if cfg.n_kv_head != cfg.n_head:
        raise unsupported_export(family, f"n_kv_head={cfg.n_kv_head}", "it has as many key/value heads as query heads")


# ------------------------------------------------------------------------------------------------------------
# Weight files
# ------------------------------------------------------------------------------------------------------------
def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory, on the CPU: single or sharded safetensors, else single or
    sharded pytorch_model.bin (loaded with weights_only=True)."""
    if (directory / SAFETENSORS_FILE).is_file():
        return _load_safetensors(directory / SAFETENSORS_FILE)
    if (directory / SAFETENSORS_INDEX).is_file():
        return _load_shards(directory, SAFETENSORS_INDEX, _load_safetensors)
    if (directory / BIN_FILE).is_file():
        return _load_bin(directory / BIN_FILE)
    if (directory / BIN_INDEX).is_file():
        return _load_shards(directory, BIN_INDEX, _load_bin)
    raise GptlabError(f"no weights in {directory}: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, "
                      f"{BIN_FILE} or {BIN_INDEX}")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise GptlabError(f"cannot read {path}: {e}") from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:  # weights_only: tensors and plain containers only, so a malicious pickle cannot run code
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:  # torch's text spans paragraphs and suggests weights_only=False: not ours
        found = re.search(r"GLOBAL [\w.]+", str(e))
        what = found.group(0) if found else "pickled code"
        raise GptlabError(f"{path} holds Python objects other than tensors ({what}), which gptlab never loads: "
                          "convert it to safetensors where you trust it") from None
    except Exception as e:  # torch's reasons may be a bare key ("101": not a torch file at all)
        raise GptlabError(f"cannot read {path} as a weights-only torch file ({type(e).__name__}: "
                          f"{' '.join(str(e).split())})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise GptlabError(f"{path} does not hold a flat state dict of tensors")
    return state


def _load_shards(directory: Path, index_name: str, load: Callable[[Path], dict]) -> dict[str, torch.Tensor]:
    index = directory / index_name
    try:
        weight_map = parse_json(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise GptlabError(f"cannot read the shard index {index}: {e!r}") from None
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if Path(name).name != name:  # the index lists sibling files; refuse paths that point elsewhere
            raise GptlabError(f"{index} names a shard outside its directory: {name!r}")
        if not (directory / name).is_file():
            raise GptlabError(f"shard {name} listed in {index} is missing")
        tensors.update(load(directory / name))
    return tensors


# ------------------------------------------------------------------------------------------------------------
# Rules: one gptlab tensor <-> the Hugging Face tensor(s) it is made of
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: tuple[str, ...]
    join: Callable[[list[torch.Tensor]], torch.Tensor]  # Hugging Face tensors -> ours
    split: Callable[[torch.Tensor], list[torch.Tensor]]  # ours -> Hugging Face tensors
    transposes: bool = False  # the Hugging Face tensor is stored (in, out): a Conv1D weight


def same(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda ts: ts[0], lambda t: [t])


def transposed(ours: str, theirs: str) -> Rule:
    """GPT-2's Conv1D stores weights as (in, out), nn.Linear as (out, in)."""
    return Rule(ours, (theirs,), lambda ts: ts[0].t(), lambda t: [t.t()], transposes=True)


def concatenated(ours: str, theirs: tuple[str, ...], sizes: list[int]) -> Rule:
    """Several Hugging Face projections stacked along the output dim into one of our fused ones."""
    return Rule(ours, theirs, lambda ts: torch.cat(ts, dim=0), lambda t: list(t.split(sizes, dim=0)))


def regrouped(ours: str, theirs: str, outer: int, inner: int, size: int) -> Rule:
    """Output rows grouped as (outer, inner, size) there and (inner, outer, size) here, e.g. GPT-NeoX's
    per-head [q k v] blocks vs our [all q | all k | all v]: a transpose of the first two row axes."""

    def swap(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return t.reshape(a, b, size, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    return Rule(ours, (theirs,), lambda ts: swap(ts[0], outer, inner), lambda t: [swap(t, inner, outer)])


def to_ours(rules: list[Rule], tensors: dict[str, torch.Tensor], ignore: re.Pattern, where: Path) -> dict:
    """Apply `rules` to a Hugging Face state dict. Any tensor no rule consumes (other than buffers matching
    `ignore`) is an error: it means the checkpoint has a part gptlab would silently drop."""
    state, used = {}, set()
    for rule in rules:
        missing = [name for name in rule.theirs if name not in tensors]
        if missing:
            raise GptlabError(f"{where} lacks weight {missing[0]!r}")
        # contiguous: a transposed Conv1D weight is a view, and the model takes these tensors as its parameters
        state[rule.ours] = rule.join([tensors[name] for name in rule.theirs]).contiguous()
        used.update(rule.theirs)
    extra = sorted(name for name in tensors if name not in used and not ignore.search(name))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise GptlabError(f"{where} has weights gptlab has no place for: {extra[0]!r}{more}")
    return state


def to_theirs(rules: list[Rule], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply `rules` backwards: our state dict -> a Hugging Face one (contiguous, ready for safetensors)."""
    leftover = set(state) - {rule.ours for rule in rules}
    if leftover:  # a bug in a family's rules, not a user error
        raise AssertionError(f"export rules miss {sorted(leftover)}")
    tensors = {}
    for rule in rules:
        for name, t in zip(rule.theirs, rule.split(state[rule.ours]), strict=True):
            tensors[name] = t.contiguous()
    return tensors


# ------------------------------------------------------------------------------------------------------------
# Small shared mappings
# ------------------------------------------------------------------------------------------------------------
# transformers' activation names -> F.gelu's `approximate`; gelu_new / gelu_fast / gelu_pytorch_tanh are three
# spellings of the same tanh formula
GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}


def gelu_approximate(activation: str) -> str:
    if activation not in GELU_APPROXIMATE:
        raise GptlabError(f"activation {activation!r} is not supported here; expected one of "
                          f"{', '.join(GELU_APPROXIMATE)}")
    return GELU_APPROXIMATE[activation]


def keep(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The identity `normalize` step, for families whose checkpoints always use one naming."""
    return tensors
