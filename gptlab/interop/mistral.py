"""Mistral (`MistralForCausalLM`): Llama without biases, plus a sliding window: each query sees the last
`sliding_window` positions, itself included (Mistral 7B v0.1: 4096; later versions set it to null)."""

from __future__ import annotations

from typing import Any

from gptlab.config import GPTConfig
from gptlab.interop.common import ANY, hf_key, keep
from gptlab.interop.llama import IGNORE, check_llama_export, llama_config, llama_config_to_hf, llama_rules

NAME = "Mistral"
ARCHITECTURE = "MistralForCausalLM"
MODEL_TYPE = "mistral"
EXPRESSES = {"norm": ("rmsnorm",), "position": ("rope",), "mlp": ("swiglu",), "block": ("pre",), "bias": (False,),
             "head_dim": ANY, "rope_scaling": ANY, "sliding_window": ANY, "global_layer_every": (None,)}
__all__ = ["IGNORE"]
normalize = keep


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    window = hf_key(hf, "sliding_window", absent=4096)  # transformers' MistralConfig default
    return {**llama_config(hf, NAME, attention_bias=False), "sliding_window": window}


def check_export(cfg: GPTConfig) -> None:
    check_llama_export(cfg, NAME)


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {**llama_config_to_hf(cfg), "sliding_window": cfg.sliding_window}


def rules(cfg: GPTConfig) -> list:
    return llama_rules(cfg)
