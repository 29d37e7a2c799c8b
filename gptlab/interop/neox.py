"""GPT-NeoX / Pythia (`GPTNeoXForCausalLM`): LayerNorm, partial RoPE, GELU MLP, parallel (or sequential)
residual, biases everywhere, an untied head called `embed_out`.

NeoX fuses q, k and v like gptlab does, but per head: its `query_key_value` output rows run
[head 0: q k v][head 1: q k v]..., each block head_size long, where gptlab's run [all q | all k | all v].
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.common import (
    ANY,
    Rule,
    check_multi_head,
    context_from_hf,
    gelu_approximate,
    hf_flag,
    hf_value,
    max_positions_to_hf,
    regrouped,
    rope_settings,
    rope_to_hf,
    same,
)

NAME = "GPT-NeoX"
ARCHITECTURE = "GPTNeoXForCausalLM"
MODEL_TYPE = "gpt_neox"
# the switches (GPTConfig fields beyond common.CARRIED) GPT-NeoX has, and the values they may take
EXPRESSES = {"norm": ("layernorm",), "position": ("rope",), "mlp": ("gelu",), "block": ("parallel", "pre"),
             "bias": (True,), "rope_scaling": ANY}
# causal-mask and RoPE buffers that older transformers saved with the weights, and a tied head saved anyway
IGNORE = re.compile(r"\.attention\.(bias|masked_bias)$|rotary_emb\.inv_freq$|^embed_out\.weight$")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if not hf_flag(hf, "attention_bias", True):
        raise GptlabError("GPT-NeoX with attention_bias=false is not supported: its MLP and LayerNorms keep "
                          "their biases, and gptlab's single `bias` switch covers all of them")
    n_embd, n_head = hf_value(hf, "hidden_size"), hf_value(hf, "num_attention_heads")
    rope_base, fraction, scaling = rope_settings(hf)
    fraction = 0.25 if fraction is None else fraction  # NeoX's default rotary_pct
    # transformers takes int(head_size * rotary_pct) dims; an odd count breaks its rotate-half (and ours)
    if isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0:
        rotary_dims = int(n_embd // n_head * fraction)
        if rotary_dims % 2:
            raise GptlabError(f"rotary_pct={fraction} gives an odd rotary dim count per head ({rotary_dims})")
    return dict(
        vocab_size=hf_value(hf, "vocab_size"),
        block_size=context_from_hf(hf_value(hf, "max_position_embeddings", default=2048), scaling),
        n_layer=hf_value(hf, "num_hidden_layers"),
        n_head=n_head,
        n_embd=n_embd,
        mlp_hidden=hf_value(hf, "intermediate_size"),
        norm="layernorm",
        norm_eps=hf_value(hf, "layer_norm_eps", default=1e-5),
        bias=True,
        position="rope",
        rope_base=rope_base,
        rotary_fraction=fraction,
        rope_scaling=scaling,
        mlp="gelu",
        gelu_approximate=gelu_approximate(hf_value(hf, "hidden_act", default="gelu")),
        block="parallel" if hf_flag(hf, "use_parallel_residual", True) else "pre",
        tie_embeddings=hf_flag(hf, "tie_word_embeddings", False),
        dropout=hf_value(hf, "hidden_dropout", default=0.0),
        init_std=hf_value(hf, "initializer_range", default=0.02),
    )


def check_export(cfg: GPTConfig) -> None:
    """What EXPRESSES can't say: GPT-NeoX has as many key/value heads as query heads."""
    check_multi_head(cfg, NAME)


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    # transformers rotates int(head_size * rotary_pct) dims, gptlab that rounded down to even: keep our
    # fraction when both agree, else write one that lands exactly on our dims
    pct = cfg.rotary_fraction
    if int(cfg.head_size * pct) != cfg.rotary_dim:
        pct = cfg.rotary_dim / cfg.head_size
        if int(cfg.head_size * pct) != cfg.rotary_dim:  # float rounding fell just below
            pct = math.nextafter(pct, 1.0)
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.hidden_size,
        "hidden_act": "gelu_new" if cfg.gelu_approximate == "tanh" else "gelu",
        "max_position_embeddings": max_positions_to_hf(cfg),
        "layer_norm_eps": cfg.norm_eps,
        # 4.x names at the top level, 5.x's rope_parameters beside them (see llama.config_to_hf)
        "rotary_pct": pct,
        "rotary_emb_base": cfg.rope_base,
        **rope_to_hf(cfg, partial_rotary_factor=pct),
        "use_parallel_residual": cfg.block == "parallel",
        "attention_bias": True,
        "attention_dropout": cfg.dropout,
        "hidden_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5.x calls the head `lm_head` in memory (renaming `embed_out` on load); accept either."""
    if "lm_head.weight" in tensors and "embed_out.weight" not in tensors:
        tensors = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in tensors.items()}
    return tensors


def rules(cfg: GPTConfig) -> list[Rule]:
    out = [same("transformer.wte.weight", "gpt_neox.embed_in.weight")]
    for i in range(cfg.n_layer):
        p, t = f"transformer.h.{i}.", f"gpt_neox.layers.{i}."
        for kind in ("weight", "bias"):
            out += [
                same(p + f"ln_1.{kind}", t + f"input_layernorm.{kind}"),
                same(p + f"ln_2.{kind}", t + f"post_attention_layernorm.{kind}"),
                # rows (n_head, 3, head_size) there, (3, n_head, head_size) here
                regrouped(p + f"attn.c_attn.{kind}", t + f"attention.query_key_value.{kind}",
                          outer=cfg.n_head, inner=3, size=cfg.head_size),
                same(p + f"attn.c_proj.{kind}", t + f"attention.dense.{kind}"),
                same(p + f"mlp.c_fc.{kind}", t + f"mlp.dense_h_to_4h.{kind}"),
                same(p + f"mlp.c_proj.{kind}", t + f"mlp.dense_4h_to_h.{kind}"),
            ]
    out += [same("transformer.ln_f.weight", "gpt_neox.final_layer_norm.weight"),
            same("transformer.ln_f.bias", "gpt_neox.final_layer_norm.bias")]
    if not cfg.tie_embeddings:
        out.append(same("lm_head.weight", "embed_out.weight"))
    return out
