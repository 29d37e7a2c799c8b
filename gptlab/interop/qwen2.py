"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama with biases on the q, k and v projections only.

Its optional sliding window (`use_sliding_window`, on the layers from `max_window_layers` up) is read from the
config's `layer_types`; the released Qwen2 and Qwen2.5 checkpoints have it off.
"""

from __future__ import annotations

from typing import Any

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.common import ANY, attention_layers, hf_flag, hf_value, keep, layer_types_to_hf
from gptlab.interop.llama import IGNORE, check_llama_export, llama_config, llama_config_to_hf, llama_rules

NAME = "Qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"
MODEL_TYPE = "qwen2"
EXPRESSES = {"norm": ("rmsnorm",), "position": ("rope",), "mlp": ("swiglu",), "block": ("pre",), "bias": (False,),
             "qkv_bias": (True,), "rope_scaling": ANY, "sliding_window": ANY, "global_layer_every": (None,)}
__all__ = ["IGNORE"]
normalize = keep


def qwen_window(hf: dict[str, Any], n_layer: int) -> tuple[int | None, int | None]:
    """(sliding_window, global_layer_every): Qwen's window applies only with use_sliding_window, on the layers
    from max_window_layers up (what 5.x's layer_types spells out)."""
    if not hf_flag(hf, "use_sliding_window", False):
        return None, None
    if hf.get("layer_types") is None:
        first = hf_value(hf, "max_window_layers", default=28)  # transformers' default for Qwen2 and Qwen3
        if isinstance(first, int) and 0 < first < n_layer and hf.get("sliding_window") is not None:
            # layer 0 attends fully and a later one slides: not all, none, nor every k-th layer global
            raise GptlabError(f"use_sliding_window with max_window_layers={first} (full attention on the first "
                              f"{first} of {n_layer} layers, the window above) is not expressible: gptlab's "
                              "sliding-window layers are all layers, none, or all but every k-th")
        hf = {**hf, "layer_types": ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]}
    return attention_layers(hf, n_layer, hf.get("sliding_window"))


def qwen_window_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": 0 if cfg.sliding_window is not None else cfg.n_layer,
            "layer_types": layer_types_to_hf(cfg)}


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = llama_config(hf, NAME, attention_bias=False)
    window, every = qwen_window(hf, fields["n_layer"])
    return {**fields, "qkv_bias": True, "sliding_window": window, "global_layer_every": every}


def check_export(cfg: GPTConfig) -> None:
    check_llama_export(cfg, NAME, shared_attention_bias=False)  # biases on q, k, v only


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {**llama_config_to_hf(cfg), **qwen_window_to_hf(cfg)}


def rules(cfg: GPTConfig) -> list:
    return llama_rules(cfg)
