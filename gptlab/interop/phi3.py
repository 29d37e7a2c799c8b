"""Phi-3 (`Phi3ForCausalLM`): Llama's block with q, k, v fused in one `qkv_proj` and gate, up in one
`gate_up_proj` (the same row order as gptlab's fused matrices, so nothing is split), optionally partial rotary,
longrope ("su") scaling for the long-context variants, and a sliding window on every layer when set."""

from __future__ import annotations

import re
from typing import Any

from gptlab.config import GPTConfig
from gptlab.interop.common import ANY, Rule, hf_value, keep, rope_to_hf, same, unsupported_export
from gptlab.interop.llama import llama_config, llama_config_to_hf

NAME = "Phi-3"
ARCHITECTURE = "Phi3ForCausalLM"
MODEL_TYPE = "phi3"
EXPRESSES = {"norm": ("rmsnorm",), "position": ("rope",), "mlp": ("swiglu",), "block": ("pre",), "bias": (False,),
             "rope_scaling": ANY, "sliding_window": ANY, "global_layer_every": (None,)}
IGNORE = re.compile(r"rotary_emb\.inv_freq$|^lm_head\.weight$")
normalize = keep


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = llama_config(hf, NAME, attention_bias=False, partial_rotary=True)
    return {**fields, "norm_eps": hf_value(hf, "rms_norm_eps", default=1e-5),  # Phi3Config's, not Llama's 1e-6
            "sliding_window": hf_value(hf, "sliding_window", default=None)}


def check_export(cfg: GPTConfig) -> None:
    """Phi-3 takes partial rotary (partial_rotary_factor), but of the scalings only longrope: transformers' Phi3
    refuses any other rope_type."""
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.kind != "longrope":
        raise unsupported_export(NAME, f"rope_scaling kind {scaling.kind}", "transformers' Phi3 runs longrope only")


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    scaling = cfg.rope_scaling
    original = scaling.original_context if scaling is not None and scaling.original_context else cfg.block_size
    fraction = cfg.rotary_dim / cfg.head_size
    return {
        **llama_config_to_hf(cfg),
        "original_max_position_embeddings": original,
        "partial_rotary_factor": fraction,
        **rope_to_hf(cfg, partial_rotary_factor=fraction),
        "sliding_window": cfg.sliding_window,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
    }


def rules(cfg: GPTConfig) -> list[Rule]:
    out = [same("transformer.wte.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layer):
        p, t = f"transformer.h.{i}.", f"model.layers.{i}."
        out += [same(p + "ln_1.weight", t + "input_layernorm.weight"),
                same(p + "ln_2.weight", t + "post_attention_layernorm.weight"),
                same(p + "attn.c_attn.weight", t + "self_attn.qkv_proj.weight"),
                same(p + "attn.c_proj.weight", t + "self_attn.o_proj.weight"),
                same(p + "mlp.c_fc.weight", t + "mlp.gate_up_proj.weight"),
                same(p + "mlp.c_proj.weight", t + "mlp.down_proj.weight")]
    out.append(same("transformer.ln_f.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        out.append(same("lm_head.weight", "lm_head.weight"))
    return out
