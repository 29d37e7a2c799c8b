"""Llama (`LlamaForCausalLM`): RMSNorm, RoPE on the whole head, SwiGLU, pre-norm, grouped-query attention.

Llama keeps q, k, v and gate, up as separate projections; gptlab fuses them (`attn.c_attn` = [q | k | v],
`mlp.c_fc` = [gate | up]), so import concatenates rows and export splits them. Hugging Face Llama checkpoints
already use the rotate-half RoPE layout gptlab uses, so no per-head permutation is needed.

Qwen2, Qwen3 and Mistral are Llama with one or two switches more; their modules reuse `llama_config` and
`llama_rules` from here.
"""

from __future__ import annotations

import re
from typing import Any

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.common import (
    ANY,
    Rule,
    concatenated,
    context_from_hf,
    hf_flag,
    hf_value,
    keep,
    max_positions_to_hf,
    rope_settings,
    rope_to_hf,
    same,
    unsupported_export,
)

NAME = "Llama"
ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
# the switches (GPTConfig fields beyond common.CARRIED) Llama has, and the values they may take
EXPRESSES = {"norm": ("rmsnorm",), "position": ("rope",), "mlp": ("swiglu",), "block": ("pre",), "bias": (False, True),
             "qkv_bias": (None, False, True), "attn_proj_bias": (None, False, True), "head_dim": ANY,
             "rope_scaling": ANY}
IGNORE = re.compile(r"rotary_emb\.inv_freq$|^lm_head\.weight$")  # old checkpoints saved the RoPE buffer
normalize = keep


def llama_config(hf: dict[str, Any], family: str, attention_bias: bool, partial_rotary: bool = False
                 ) -> dict[str, Any]:
    """The GPTConfig fields every Llama-shaped family shares; the family adds its own. `partial_rotary`: the
    family honours partial_rotary_factor (Phi-3); Llama, Qwen and Mistral ignore it and rotate whole heads."""
    act = hf_value(hf, "hidden_act", default="silu")
    if act not in ("silu", "swish"):
        raise GptlabError(f"{family} with hidden_act={act!r} is not supported: gptlab's SwiGLU uses silu")
    rope_base, fraction, scaling = rope_settings(hf)
    max_pos = hf_value(hf, "max_position_embeddings", default=2048)
    return dict(
        vocab_size=hf_value(hf, "vocab_size"),
        block_size=context_from_hf(max_pos, scaling),
        n_layer=hf_value(hf, "num_hidden_layers"),
        n_head=hf_value(hf, "num_attention_heads"),
        n_kv_head=hf_value(hf, "num_key_value_heads", default=hf_value(hf, "num_attention_heads")),
        n_embd=hf_value(hf, "hidden_size"),
        head_dim=hf.get("head_dim"),
        mlp_hidden=hf_value(hf, "intermediate_size"),
        norm="rmsnorm",
        norm_eps=hf_value(hf, "rms_norm_eps", default=1e-6),
        bias=False,
        qkv_bias=attention_bias,
        attn_proj_bias=attention_bias,
        position="rope",
        rope_base=rope_base,
        rotary_fraction=fraction if partial_rotary and fraction is not None else 1.0,
        rope_scaling=scaling,
        mlp="swiglu",
        block="pre",
        tie_embeddings=hf_flag(hf, "tie_word_embeddings", False),
        dropout=hf_value(hf, "attention_dropout", default=0.0),
        init_std=hf_value(hf, "initializer_range", default=0.02),
    )


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = llama_config(hf, NAME, hf_flag(hf, "attention_bias", False))
    fields["bias"] = hf_flag(hf, "mlp_bias", False)
    return fields


def check_export(cfg: GPTConfig) -> None:
    check_llama_export(cfg, NAME)


def check_llama_export(cfg: GPTConfig, family: str, shared_attention_bias: bool = True) -> None:
    """What EXPRESSES can't say: these families rotate every dim of each head, and (but Qwen2, whose q, k, v have
    biases and o has none) one attention_bias flag biases q, k, v and o together."""
    if cfg.rotary_dim != cfg.head_size:
        raise unsupported_export(family, f"rotary_fraction={cfg.rotary_fraction}", "it rotates every dim of each head")
    if shared_attention_bias and cfg.has_bias("qkv") != cfg.has_bias("attn_proj"):
        raise unsupported_export(family, f"qkv_bias={cfg.has_bias('qkv')} with attn_proj_bias="
                                 f"{cfg.has_bias('attn_proj')}", "attention_bias covers q, k, v and o together")


def llama_config_to_hf(cfg: GPTConfig, activation: dict[str, str] | None = None) -> dict[str, Any]:
    """The config.json keys every Llama-shaped family (Gemma 2 and Phi-3 too) shares; `activation`: the family's
    key and value for it, else Llama's hidden_act silu."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_size,
        **(activation or {"hidden_act": "silu"}),
        "max_position_embeddings": max_positions_to_hf(cfg),
        "rms_norm_eps": cfg.norm_eps,
        **rope_to_hf(cfg),
        "attention_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {**llama_config_to_hf(cfg), "attention_bias": cfg.has_bias("qkv"), "mlp_bias": cfg.has_bias("mlp"),
            "pretraining_tp": 1}


# a block's norms: ours -> Llama's (Gemma 2 names four)
LLAMA_NORMS = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}


def llama_rules(cfg: GPTConfig, qk_norm: bool = False, norms: dict[str, str] = LLAMA_NORMS) -> list[Rule]:
    """Llama's names, biases where the config has them; `qk_norm`: Qwen3's per-head q_norm and k_norm."""
    q, kv, hidden = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size, cfg.hidden_size
    out = [same("transformer.wte.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layer):
        p, t = f"transformer.h.{i}.", f"model.layers.{i}."
        attn, mlp = t + "self_attn.", t + "mlp."
        out += [same(p + f"{ours}.weight", t + f"{theirs}.weight") for ours, theirs in norms.items()]
        if qk_norm:
            out += [same(p + "attn.q_norm.weight", attn + "q_norm.weight"),
                    same(p + "attn.k_norm.weight", attn + "k_norm.weight")]
        for kind in ("weight", "bias"):
            if kind == "weight" or cfg.has_bias("qkv"):
                out.append(concatenated(p + f"attn.c_attn.{kind}", tuple(attn + f"{x}_proj.{kind}" for x in "qkv"),
                                        [q, kv, kv]))
            if kind == "weight" or cfg.has_bias("attn_proj"):
                out.append(same(p + f"attn.c_proj.{kind}", attn + f"o_proj.{kind}"))
            if kind == "weight" or cfg.has_bias("mlp"):
                out += [concatenated(p + f"mlp.c_fc.{kind}", (mlp + f"gate_proj.{kind}", mlp + f"up_proj.{kind}"),
                                     [hidden, hidden]),
                        same(p + f"mlp.c_proj.{kind}", mlp + f"down_proj.{kind}")]
    out.append(same("transformer.ln_f.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        out.append(same("lm_head.weight", "lm_head.weight"))
    return out


def rules(cfg: GPTConfig) -> list[Rule]:
    return llama_rules(cfg)
