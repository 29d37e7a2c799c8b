"""Llama (`LlamaForCausalLM`): RMSNorm, RoPE on the whole head, SwiGLU, pre-norm, grouped-query attention.

Llama keeps q, k, v and gate, up as separate projections; gptlab fuses them (`attn.c_attn` = [q | k | v],
`mlp.c_fc` = [gate | up]), so import concatenates rows and export splits them. Hugging Face Llama checkpoints
already use the rotate-half RoPE layout gptlab uses, so no per-head permutation is needed.
"""

from __future__ import annotations

import re
from typing import Any

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.common import Rule, concatenated, get, keep, rope_settings, same, unsupported_export

NAME = "Llama"
ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
# the switches (GPTConfig fields beyond common.CARRIED) Llama has, and the values they may take
EXPRESSES = {"norm": ("rmsnorm",), "position": ("rope",), "mlp": ("swiglu",), "block": ("pre",), "bias": (False, True)}
IGNORE = re.compile(r"rotary_emb\.inv_freq$|^lm_head\.weight$")  # old checkpoints saved the RoPE buffer
normalize = keep


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = get(hf, "hidden_act", default="silu")
    if act not in ("silu", "swish"):
        raise GptlabError(f"Llama with hidden_act={act!r} is not supported: gptlab's SwiGLU uses silu")
    n_embd, n_head = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_head != n_embd:
        raise GptlabError(f"head_dim={head_dim} differs from hidden_size / num_attention_heads = {n_embd} / "
                          f"{n_head}: gptlab's heads are always hidden_size / num_attention_heads wide")
    attention_bias = bool(get(hf, "attention_bias", default=False))
    mlp_bias = bool(get(hf, "mlp_bias", default=False))
    if attention_bias != mlp_bias:
        raise GptlabError(f"attention_bias={attention_bias} but mlp_bias={mlp_bias}: gptlab's single `bias` "
                          "switch needs both the same")
    # transformers' Llama ignores partial_rotary_factor and rotates whole heads, so gptlab does the same
    rope_base, _ = rope_settings(hf)
    return dict(
        vocab_size=get(hf, "vocab_size"),
        block_size=get(hf, "max_position_embeddings", default=2048),
        n_layer=get(hf, "num_hidden_layers"),
        n_head=n_head,
        n_kv_head=get(hf, "num_key_value_heads", default=n_head),
        n_embd=n_embd,
        mlp_hidden=get(hf, "intermediate_size"),
        norm="rmsnorm",
        norm_eps=get(hf, "rms_norm_eps", default=1e-6),
        bias=attention_bias,
        position="rope",
        rope_base=rope_base,
        rotary_fraction=1.0,
        mlp="swiglu",
        block="pre",
        tie_embeddings=bool(get(hf, "tie_word_embeddings", default=False)),
        dropout=get(hf, "attention_dropout", default=0.0),
        init_std=get(hf, "initializer_range", default=0.02),
    )


def check_export(cfg: GPTConfig) -> None:
    """What EXPRESSES can't say: Llama rotates every dim of each head."""
    if cfg.rotary_dim != cfg.head_size:
        raise unsupported_export(NAME, f"rotary_fraction={cfg.rotary_fraction}", "it rotates every dim of each head")


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        # 4.x reads the top-level rope_theta and rope_scaling; 5.x reads rope_parameters (and would also
        # convert the top-level key): writing both keeps either version from guessing
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
    }


def rules(cfg: GPTConfig) -> list[Rule]:
    q, kv, hidden = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size, cfg.hidden_size
    out = [same("transformer.wte.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layer):
        p, t = f"transformer.h.{i}.", f"model.layers.{i}."
        out += [same(p + "ln_1.weight", t + "input_layernorm.weight"),
                same(p + "ln_2.weight", t + "post_attention_layernorm.weight")]
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            attn, mlp = t + "self_attn.", t + "mlp."
            out += [
                concatenated(p + f"attn.c_attn.{kind}", tuple(attn + f"{x}_proj.{kind}" for x in "qkv"),
                             [q, kv, kv]),
                same(p + f"attn.c_proj.{kind}", attn + f"o_proj.{kind}"),
                concatenated(p + f"mlp.c_fc.{kind}", (mlp + f"gate_proj.{kind}", mlp + f"up_proj.{kind}"),
                             [hidden, hidden]),
                same(p + f"mlp.c_proj.{kind}", mlp + f"down_proj.{kind}"),
            ]
    out.append(same("transformer.ln_f.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        out.append(same("lm_head.weight", "lm_head.weight"))
    return out
