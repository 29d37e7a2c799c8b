"""Qwen3 (`Qwen3ForCausalLM`): Llama with a learned RMSNorm on each head's q and k (before RoPE), heads wider
than hidden_size / num_attention_heads, and (usually) no biases."""

from __future__ import annotations

from typing import Any

from gptlab.config import GPTConfig
from gptlab.interop.common import ANY, hf_flag, keep
from gptlab.interop.llama import IGNORE, check_llama_export, llama_config, llama_config_to_hf, llama_rules
from gptlab.interop.qwen2 import qwen_window, qwen_window_to_hf

NAME = "Qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
EXPRESSES = {"norm": ("rmsnorm",), "position": ("rope",), "mlp": ("swiglu",), "block": ("pre",), "bias": (False,),
             "qkv_bias": (None, True), "attn_proj_bias": (None, True), "head_dim": ANY, "qk_norm": (True,),
             "qk_norm_weight": (True,), "rope_scaling": ANY, "sliding_window": ANY, "global_layer_every": (None,)}
__all__ = ["IGNORE"]
normalize = keep


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = llama_config(hf, NAME, attention_bias=hf_flag(hf, "attention_bias", False))
    window, every = qwen_window(hf, fields["n_layer"])
    return {**fields, "qk_norm": True, "qk_norm_weight": True, "sliding_window": window, "global_layer_every": every}


def check_export(cfg: GPTConfig) -> None:
    check_llama_export(cfg, NAME)


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {**llama_config_to_hf(cfg), "attention_bias": cfg.has_bias("qkv"), **qwen_window_to_hf(cfg)}


def rules(cfg: GPTConfig) -> list:
    return llama_rules(cfg, qk_norm=True)
