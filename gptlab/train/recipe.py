"""Reading a recipe: a flat TOML file and command-line overrides into a checked `TrainConfig`.

A recipe names a model preset (`model = "speedrun-char"`) and may override any `GPTConfig` field at the top
level (`n_layer = 4`); all other keys are training settings, the fields of `TrainConfig`. Values are checked
against the field's type, so a typo or a wrong type is a one-line error instead of a silent default. TOML values
must already have the right type; overrides arrive as text (`{"max_steps": "500"}`, split out of `--key value` by
the command line) and are parsed by the field's type. No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from gptlab.config import GPTConfig
from gptlab.data.dataset import DATA_TABLE, META
from gptlab.errors import GptlabError
from gptlab.fileio import read_toml
from gptlab.train.config import TrainConfig, validate

_TRAIN_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "model_overrides"}
_MODEL_FIELDS = {f.name for f in dataclasses.fields(GPTConfig) if f.name not in ("vocab_size", "name")}


def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


# ------------------------------------------------------------------------------------------------------------
# Values: parse command-line strings and check TOML values against a field's type
# ------------------------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is tuple:
        return f"list of {len(typing.get_args(tp))} numbers"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


def coerce(key: str, value: Any, tp: Any, from_text: bool) -> Any:
    """`value` as type `tp`: strings are parsed when `from_text` (command line), else the type must match."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value in args:
            return value
    elif origin in (typing.Union, types.UnionType):  # X | Y, Optional[X]
        if type(None) in args and (value is None or (from_text and str(value).strip().lower() in ("none", "null"))):
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner:
            try:
                return coerce(key, value, a, from_text)
            except GptlabError:
                pass
    elif origin is tuple and args[-1:] == (Ellipsis,):  # a list of any length; one item may stand alone
        items = [s for s in value.split(",") if s.strip()] if from_text and isinstance(value, str) else value
        items = [items] if isinstance(items, str) else items
        if isinstance(items, (list, tuple)):
            return tuple(coerce(key, v.strip() if from_text else v, args[0], from_text) for v in items)
    elif origin is tuple:
        items = value
        if from_text and isinstance(value, str):
            items = [s for s in value.strip("[]() ").split(",") if s.strip()]
        if isinstance(items, (list, tuple)) and len(items) == len(args):
            return tuple(coerce(key, v, a, from_text) for v, a in zip(items, args, strict=True))
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return _parse_bool(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise GptlabError(f"{key} = {value!r}: expected {_type_name(tp)}")


def _field_type(key: str) -> Any:
    if key in _TRAIN_FIELDS:
        return _types(TrainConfig)[key]
    return _types(GPTConfig)[key]


def _unknown_key(key: str, where: str) -> GptlabError:
    known = sorted(set(_TRAIN_FIELDS) | _MODEL_FIELDS)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see configs/*.toml for the keys"
    return GptlabError(f"unknown key {key!r} {where}{hint}")


# ------------------------------------------------------------------------------------------------------------
# Loading a recipe
# ------------------------------------------------------------------------------------------------------------
def _load_toml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise GptlabError(f"config file {path} is a directory, not a TOML recipe{_directory_hint(path)}")
    if not path.is_file():
        raise GptlabError(f"config file {path} not found (recipes live in configs/*.toml)")
    return read_toml(path)


def _directory_hint(path: Path) -> str:
    """Where a directory given as the recipe belongs, by what it holds: prepared data, a run, a checkpoint."""
    from gptlab.checkpoint import RESOLVED_CONFIG, has_weights, list_step_checkpoints  # (torch: on this error only)

    recipes = "(recipes live in configs/*.toml)"
    if (path / META).is_file():
        return f": it looks like prepared data, which goes to --data {path} {recipes}"
    if (path / RESOLVED_CONFIG).is_file() or list_step_checkpoints(path):
        return (f": it looks like a run directory; continue it with its recipe: gptlab train RECIPE.toml --out "
                f"{path} --resume")
    if has_weights(path):
        return f": it looks like a checkpoint; fine-tune from it with --init-from {path} {recipes}"
    return f" {recipes}"


def build_train_config(
    values: dict[str, Any], overrides: dict[str, str] | None = None, where: str = "in the config"
) -> TrainConfig:
    """A TrainConfig from TOML values (type-checked) and command-line overrides (parsed by field type)."""
    train: dict[str, Any] = {}
    model: dict[str, Any] = {}
    items = [(k, v, False, where) for k, v in values.items()]
    items += [(k, v, True, "on the command line") for k, v in (overrides or {}).items()]
    for key, value, from_text, origin in items:
        if key in _TRAIN_FIELDS:
            train[key] = coerce(key, value, _field_type(key), from_text)
        elif key in _MODEL_FIELDS:
            model[key] = coerce(key, value, _field_type(key), from_text)
        else:
            raise _unknown_key(key, origin)
    cfg = TrainConfig(**train, model_overrides=model)
    validate(cfg)
    return cfg


def load_train_config(path: str | Path, overrides: dict[str, str] | None = None) -> TrainConfig:
    """The TrainConfig of a TOML recipe, with `overrides` (key -> text, as typed on a command line) on top."""
    path = Path(path)
    values = _load_toml(path)
    values.pop(DATA_TABLE, None)  # the data's sources: `gptlab.data.dataset.recipe_sources` reads them
    nested = [k for k, v in values.items() if isinstance(v, dict)]
    if nested:
        raise GptlabError(f"{path}: tables like [{nested[0]}] are not used; write every key at the top level")
    return build_train_config(values, overrides, where=f"in {path}")
