"""`from_hf` and `save_hf`: Hugging Face model directories <-> gptlab `GPT`s, for the families gptlab's
switches can express exactly (`registry.FAMILIES`). The per-family knowledge lives in one module per family;
this module picks the family and moves the tensors.

Export picks the family whose switches (its EXPRESSES) take every switch of the config and whose `check_export`
takes what they cannot say; a switch no family lists must be at GPTConfig's default. So a config gptlab can build
but no family can hold (a new position scheme, a new switch) is refused with its name, never written as a
different model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from gptlab.checkpoint import assign_weights, check_floating, model_state_dict, save_tensors, unwrap_model
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_dir
from gptlab.hardware import resolve_device, weights_dtype
from gptlab.interop.common import CARRIED, SAFETENSORS_FILE, read_hf_config, read_hf_weights, to_ours, to_theirs
from gptlab.interop.registry import BY_ARCHITECTURE, BY_MODEL_TYPE, FAMILIES, SUPPORTED_ARCHITECTURES
from gptlab.lora import has_lora
from gptlab.model import GPT

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

GPT2_VOCAB, GPT2_EOT = 50257, 50256


# ------------------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------------------
def _family_of(hf: dict[str, Any]) -> ModuleType:
    architectures = hf.get("architectures")
    if isinstance(architectures, list) and architectures:
        name = architectures[0]
    elif hf.get("model_type") in BY_MODEL_TYPE:  # configs written without `architectures`
        return BY_MODEL_TYPE[hf["model_type"]]
    else:
        name = f"model_type {hf.get('model_type')!r}"
    if name not in BY_ARCHITECTURE:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise GptlabError(f"unsupported architecture {name}: gptlab converts {supported}")
    return BY_ARCHITECTURE[name]


def config_from_hf(hf: dict[str, Any], name: str = "custom") -> GPTConfig:
    """The GPTConfig for a Hugging Face config.json dict (4.x or 5.x schema)."""
    family = _family_of(hf)
    try:
        return GPTConfig(**family.config_from_hf(hf), name=name, hf_architecture=family.ARCHITECTURE)
    except (ValueError, TypeError) as e:
        raise GptlabError(f"config.json does not describe a valid {family.ARCHITECTURE}: {e}") from None


def _switches_missing(family: ModuleType, cfg: GPTConfig) -> list[str]:
    """The config's switches `family` cannot express, as "name=value"."""
    missing = []
    for f in dataclasses.fields(cfg):
        if f.name in CARRIED:
            continue
        value, allowed = getattr(cfg, f.name), family.EXPRESSES.get(f.name)
        if (allowed is None and value != f.default) or (allowed is not None and value not in allowed):
            missing.append(f"{f.name}={value}")
    return missing


def export_family(cfg: GPTConfig) -> ModuleType:
    """The family a config exports to, or a GptlabError naming the switch with no Hugging Face equivalent."""
    missing = {family: _switches_missing(family, cfg) for family in FAMILIES}
    # the family the model came from first (a Phi-3 stays a Phi-3 even where Llama's switches fit too)
    fitting = sorted((family for family in FAMILIES if not missing[family]),
                     key=lambda family: family.ARCHITECTURE != cfg.hf_architecture)
    if not fitting:
        nearest = min(FAMILIES, key=lambda family: len(missing[family]))  # the first of the closest
        names = ", ".join(family.NAME for family in FAMILIES)
        first, rest = missing[nearest][0], missing[nearest][1:]
        near = f"the nearest, {nearest.NAME}, also lacks {', '.join(rest)}" if rest else f"nearest: {nearest.NAME}"
        raise GptlabError(f"cannot export to Hugging Face: {first} has no equivalent in any family gptlab writes "
                          f"({names}); {near}")
    # a family can fit every switch and still refuse a relation between them (Llama: partial rotary), which the
    # next family may hold (Phi-3): the first that takes the config wins, else the first one's reason
    refusals = []
    for family in fitting:
        try:
            family.check_export(cfg)
        except GptlabError as e:
            refusals.append(e)
        else:
            return family
    raise refusals[0]


def config_to_hf(
    cfg: GPTConfig, dtype: torch.dtype = torch.float32, tokenizer: TextTokenizer | None = None
) -> dict[str, Any]:
    """A config.json dict that transformers 4.x and 5.x both read; GptlabError if `cfg` has no equivalent."""
    family = export_family(cfg)
    if tokenizer is not None and getattr(tokenizer, "eot_id", None) is not None:
        eos = tokenizer.eot_id
        bos = tokenizer.bos_id if getattr(tokenizer, "bos_id", None) is not None else eos
    else:  # GPT-2's vocabulary: <|endoftext|> is both; otherwise gptlab cannot know
        eos = bos = GPT2_EOT if cfg.vocab_size == GPT2_VOCAB else None
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [family.ARCHITECTURE],
        "model_type": family.MODEL_TYPE,
        **family.config_to_hf(cfg),
        # written even when null: GPT-2's config class would otherwise default both to 50256
        "bos_token_id": bos,
        "eos_token_id": eos,
        # null, not a family's default (Phi-3's 32000 lies outside a smaller vocabulary)
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype_name,  # the 4.x key
        "dtype": dtype_name,  # the 5.x key
    }


# ------------------------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------------------------
def from_hf(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None
) -> GPT:
    """Load a Hugging Face model directory (any family in `registry.FAMILIES`) as a gptlab `GPT`, in eval mode.

    Reads config.json and the weights itself, so `transformers` need not be installed. `dtype=None` keeps the
    checkpoint's dtype (that of its token embedding).
    """
    # checked before the weights are read: a device this machine lacks was an AssertionError from torch's CUDA
    device = resolve_device(str(device), flag="device")
    dtype = weights_dtype(dtype)
    directory = Path(path)
    if not directory.is_dir():
        raise GptlabError(f"{directory} is not a directory: pass a Hugging Face model directory")
    hf = read_hf_config(directory)
    try:
        family = _family_of(hf)
        config = config_from_hf(hf, name=directory.resolve().name)
    except GptlabError as e:  # named by its path: a user may hold many model directories
        path, message = directory / "config.json", str(e)
        raise GptlabError(message.replace("config.json", str(path), 1) if message.startswith("config.json")
                          else f"{path}: {message}") from None
    tensors = family.normalize(read_hf_weights(directory))
    # before fusing (torch.cat promotes) and the cast below, either of which would turn integers into weights; old
    # checkpoints' causal-mask buffers (IGNORE) may be bool
    check_floating({name: t for name, t in tensors.items() if not family.IGNORE.search(name)}, str(directory))
    state = to_ours(family.rules(config), tensors, family.IGNORE, directory)
    del tensors
    dtype = dtype or state["transformer.wte.weight"].dtype
    with torch.device("meta"):
        model = GPT(config)
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    if config.tie_embeddings:  # the embedding matrix is the head, whatever the file says under the head's name
        state["lm_head.weight"] = state["transformer.wte.weight"]
    # a config.json that disagrees with its weights is named here, before torch would fail on a shape
    return assign_weights(model, state, where=f"{directory} (against its config.json)")


# ------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------
def save_hf(model: torch.nn.Module, path: str | Path, tokenizer: TextTokenizer | None = None) -> Path:
    """Write `model` as a Hugging Face directory (config.json + model.safetensors, atomically) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads. With a tokenizer, its files go in too (see
    `write_tokenizer`). Raises GptlabError naming the switch when the config has no Hugging Face
    equivalent."""

    plain = unwrap_model(model)
    config: GPTConfig = plain.config
    family = export_family(config)  # fail before touching the disk
    state = whole_model_state(plain)
    dtype = state["transformer.wte.weight"].dtype
    tensors = to_theirs(family.rules(config), state)
    hf_config = config_to_hf(config, dtype, tokenizer)

    def write(tmp: Path) -> None:
        # metadata format=pt: transformers refuses safetensors files without it
        save_tensors(tensors, tmp / SAFETENSORS_FILE, {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None:
            write_tokenizer(tmp, tokenizer)

    return atomic_write_dir(path, write, needed=sum(t.nbytes for t in tensors.values()))


def whole_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of the model, for an export of the whole model (a LoRA model's saved state is its adapters)."""
    if has_lora(model):
        raise GptlabError("the model has unmerged LoRA adapters: merge them into its weights first "
                          "(gptlab.lora.merge_lora), or write them as a peft adapter (save_peft_adapter)")
    return model_state_dict(model)


def write_tokenizer(directory: Path, tokenizer: TextTokenizer) -> bool:
    """Save a gptlab tokenizer into a Hugging Face directory; True if transformers can load it too.

    `Tokenizer.save` always writes gptlab's tokenizer_meta.json (so `gptlab convert` can come back), and for
    Hugging Face-backed tokenizers also tokenizer.json; for those a tokenizer_config.json naming the special
    tokens makes the directory loadable with `AutoTokenizer`. Character and tiktoken GPT-2 tokenizers have no
    tokenizer.json, so transformers gets none.
    """
    tokenizer.save(directory)
    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        return False
    from tokenizers import Tokenizer as HFTok

    tok = HFTok.from_file(str(tok_file))
    eos = tok.id_to_token(tokenizer.eot_id) if tokenizer.eot_id is not None else None
    bos = tok.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else eos
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
                  "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template:
        tok_config["chat_template"] = tokenizer.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return True
