"""Gemma 2 (`Gemma2ForCausalLM`): embeddings scaled by sqrt(hidden_size), RMSNorm as x * (1 + w), GeGLU (tanh
GELU), norms before and after both attention and MLP ("sandwich" blocks), heads of width head_dim (not
hidden_size / heads), scores scaled by query_pre_attn_scalar^-1/2 and soft-capped, final logits soft-capped, and
sliding-window layers alternating with global ones (layer_types; before 5.x, even layers slide).
"""

from __future__ import annotations

import re
from typing import Any

from gptlab.config import GPTConfig
from gptlab.interop.common import (
    ANY,
    Rule,
    attention_layers,
    context_from_hf,
    gelu_approximate,
    hf_flag,
    hf_key,
    hf_value,
    keep,
    layer_types_to_hf,
    rope_settings,
)
from gptlab.interop.llama import check_llama_export, llama_config_to_hf, llama_rules

NAME = "Gemma 2"
ARCHITECTURE = "Gemma2ForCausalLM"
MODEL_TYPE = "gemma2"
EXPRESSES = {"norm": ("rmsnorm",), "norm_unit_offset": (True,), "scale_embeddings": (True,), "position": ("rope",),
             "mlp": ("geglu",), "block": ("sandwich",), "bias": (False,), "qkv_bias": (None, True),
             "attn_proj_bias": (None, True), "head_dim": ANY, "attn_scale": ANY, "attn_softcap": ANY,
             "logit_softcap": ANY, "sliding_window": ANY, "global_layer_every": ANY, "rope_scaling": ANY}
IGNORE = re.compile(r"rotary_emb\.inv_freq$|^lm_head\.weight$")
normalize = keep


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    rope_base, _, scaling = rope_settings(hf)
    n_layer = hf_value(hf, "num_hidden_layers")
    head_dim = hf_value(hf, "head_dim", default=256)
    if hf.get("layer_types") is None:  # before 5.x: even layers slide, odd ones are global
        hf = {**hf, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]}
    # a key the file leaves out takes Gemma2Config's default (a null turns the window or a cap off)
    window, every = attention_layers(hf, n_layer, hf_key(hf, "sliding_window", absent=4096))
    attention_bias = hf_flag(hf, "attention_bias", False)
    return dict(
        vocab_size=hf_value(hf, "vocab_size"),
        block_size=context_from_hf(hf_value(hf, "max_position_embeddings", default=8192), scaling),
        n_layer=n_layer,
        n_head=hf_value(hf, "num_attention_heads"),
        n_kv_head=hf_value(hf, "num_key_value_heads", default=hf_value(hf, "num_attention_heads")),
        n_embd=hf_value(hf, "hidden_size"),
        head_dim=head_dim,
        mlp_hidden=hf_value(hf, "intermediate_size"),
        norm="rmsnorm",
        norm_unit_offset=True,
        norm_eps=hf_value(hf, "rms_norm_eps", default=1e-6),
        scale_embeddings=True,
        bias=False,
        qkv_bias=attention_bias,
        attn_proj_bias=attention_bias,
        position="rope",
        rope_base=rope_base,
        rope_scaling=scaling,
        mlp="geglu",
        gelu_approximate=gelu_approximate(hf_value(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")),
        block="sandwich",
        attn_scale=float(hf_value(hf, "query_pre_attn_scalar", default=256)) ** -0.5,
        attn_softcap=hf_key(hf, "attn_logit_softcapping", absent=50.0),
        logit_softcap=hf_key(hf, "final_logit_softcapping", absent=30.0),
        sliding_window=window,
        global_layer_every=every,
        tie_embeddings=hf_flag(hf, "tie_word_embeddings", True),
        dropout=hf_value(hf, "attention_dropout", default=0.0),
        init_std=hf_value(hf, "initializer_range", default=0.02),
    )


def check_export(cfg: GPTConfig) -> None:
    check_llama_export(cfg, NAME)


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_size ** -0.5
    scalar = scale ** -2
    activation = "gelu_pytorch_tanh" if cfg.gelu_approximate == "tanh" else "gelu"
    return {
        **llama_config_to_hf(cfg, {"hidden_activation": activation}),
        "attention_bias": cfg.has_bias("qkv"),
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.logit_softcap,
        "sliding_window": cfg.sliding_window,
        "layer_types": layer_types_to_hf(cfg),
    }


def rules(cfg: GPTConfig) -> list[Rule]:
    return llama_rules(cfg, norms={"ln_1": "input_layernorm", "ln_attn_out": "post_attention_layernorm",
                                   "ln_2": "pre_feedforward_layernorm", "ln_mlp_out": "post_feedforward_layernorm"})
