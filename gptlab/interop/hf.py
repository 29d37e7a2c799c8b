"""`from_hf` and `save_hf`: Hugging Face model directories <-> gptlab `GPT`s, for the three families gptlab's
switches can express exactly (GPT-2, Llama, GPT-NeoX). The per-family knowledge lives in gpt2.py, llama.py and
neox.py; this module picks the family and moves the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save_file

from gptlab.checkpoint import assign_weights, atomic_write_dir, model_state_dict, unwrap_model
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop import gpt2, llama, neox
from gptlab.interop.common import (
    SAFETENSORS_FILE,
    SUPPORTED_ARCHITECTURES,
    read_hf_config,
    read_hf_weights,
    to_ours,
    to_theirs,
    unsupported_export,
)
from gptlab.model import GPT

FAMILIES: dict[str, ModuleType] = {f.ARCHITECTURE: f for f in (gpt2, llama, neox)}
_BY_MODEL_TYPE = {f.MODEL_TYPE: f for f in FAMILIES.values()}
GPT2_VOCAB, GPT2_EOT = 50257, 50256


# ------------------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------------------
def _family_of(hf: dict[str, Any]) -> ModuleType:
    architectures = hf.get("architectures")
    if isinstance(architectures, list) and architectures:
        name = architectures[0]
    elif hf.get("model_type") in _BY_MODEL_TYPE:  # configs written without `architectures`
        return _BY_MODEL_TYPE[hf["model_type"]]
    else:
        name = f"model_type {hf.get('model_type')!r}"
    if name not in FAMILIES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise GptlabError(f"unsupported architecture {name}: gptlab converts {supported}")
    return FAMILIES[name]


def config_from_hf(hf: dict[str, Any], name: str = "custom") -> GPTConfig:
    """The GPTConfig for a Hugging Face config.json dict (4.x or 5.x schema)."""
    family = _family_of(hf)
    try:
        return GPTConfig(**family.config_from_hf(hf), name=name)
    except (ValueError, TypeError) as e:
        raise GptlabError(f"config.json does not describe a valid {family.ARCHITECTURE}: {e}") from None


def _export_family(cfg: GPTConfig) -> ModuleType:
    """The family a config exports to, or a GptlabError naming the switch with no Hugging Face equivalent."""
    if cfg.qk_norm:
        raise unsupported_export("qk_norm=True", "none of them normalizes queries and keys")
    if cfg.logit_softcap is not None:
        raise unsupported_export(f"logit_softcap={cfg.logit_softcap}", "none of them caps the logits")
    if cfg.mlp == "relu2":
        raise unsupported_export("mlp=relu2", "their MLPs are GELU or SwiGLU")
    if cfg.block == "post":
        raise unsupported_export("block=post", "they are pre-norm or parallel")
    if cfg.position == "none":
        raise unsupported_export("position=none", "they use learned positions or RoPE")
    family = gpt2 if cfg.position == "learned" else llama if cfg.norm == "rmsnorm" else neox
    family.check_export(cfg)
    return family


def config_to_hf(cfg: GPTConfig, dtype: torch.dtype = torch.float32, tokenizer: Any = None) -> dict[str, Any]:
    """A config.json dict that transformers 4.x and 5.x both read; GptlabError if `cfg` has no equivalent."""
    family = _export_family(cfg)
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
    """Load a Hugging Face model directory (GPT-2, Llama or GPT-NeoX) as a gptlab `GPT`, in eval mode.

    Reads config.json and the weights itself, so `transformers` need not be installed. `dtype=None` keeps the
    checkpoint's dtype (that of its token embedding).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise GptlabError(f"{directory} is not a directory: pass a Hugging Face model directory")
    hf = read_hf_config(directory)
    family = _family_of(hf)
    config = config_from_hf(hf, name=directory.resolve().name)
    tensors = family.normalize(read_hf_weights(directory))
    state = to_ours(family.rules(config), tensors, family.IGNORE, directory)
    del tensors
    if isinstance(dtype, str):
        dtype = _dtype(dtype)
    dtype = dtype or state["transformer.wte.weight"].dtype
    with torch.device("meta"):
        model = GPT(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, t in state.items():  # a config.json that disagrees with its weights: say so before torch does
        if tuple(t.shape) != expected[name]:
            raise GptlabError(f"{directory}: weight for {name} has shape {tuple(t.shape)} but config.json "
                              f"implies {expected[name]}")
        state[name] = t.to(device=device, dtype=dtype)
    if config.tie_embeddings:  # the embedding matrix is the head, whatever the file says under the head's name
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return assign_weights(model, state)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise GptlabError(f"unknown dtype {name!r}: use float32, bfloat16 or float16")
    return dtype


# ------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------
def save_hf(model: torch.nn.Module, path: str | Path, tokenizer: Any = None) -> Path:
    """Write `model` as a Hugging Face directory (config.json + model.safetensors, atomically) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads. With a tokenizer, its files go in too (see
    `write_tokenizer`). Raises GptlabError naming the switch when the config has no Hugging Face
    equivalent."""

    plain = unwrap_model(model)
    config: GPTConfig = plain.config
    family = _export_family(config)  # fail before touching the disk
    state = model_state_dict(plain)
    dtype = state["transformer.wte.weight"].dtype
    tensors = to_theirs(family.rules(config), state)
    hf_config = config_to_hf(config, dtype, tokenizer)

    def write(tmp: Path) -> None:
        # metadata format=pt: transformers refuses safetensors files without it
        save_file(tensors, str(tmp / SAFETENSORS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None:
            write_tokenizer(tmp, tokenizer)

    return atomic_write_dir(path, write)


def write_tokenizer(directory: Path, tokenizer: Any) -> bool:
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
