"""GPT-J (`GPTJForCausalLM`): a parallel block whose attention and MLP read one shared LayerNorm, RoPE on the first
rotary_dim dims of each head in the interleaved ("rotate every two") layout, no biases in attention but biases in
the MLP, and an untied LM head with a bias.

q, k and v are separate projections there and one fused matrix here ([q | k | v] rows); the RoPE layout is the
same on both sides, so no rows are permuted.
"""

from __future__ import annotations

import re
from typing import Any

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.common import (
    Rule,
    check_multi_head,
    concatenated,
    gelu_approximate,
    hf_flag,
    hf_key,
    hf_value,
    keep,
    same,
    unsupported_export,
)

NAME = "GPT-J"
ARCHITECTURE = "GPTJForCausalLM"
MODEL_TYPE = "gptj"
EXPRESSES = {"norm": ("layernorm",), "position": ("rope",), "mlp": ("gelu",), "block": ("parallel",),
             "shared_norm": (True,), "rope_interleaved": (True,), "bias": (True,), "qkv_bias": (False,),
             "attn_proj_bias": (False,), "head_bias": (True,)}
# the causal-mask and sin/cos buffers older checkpoints saved, and a tied head saved anyway
IGNORE = re.compile(r"\.attn\.(bias|masked_bias)$|embed_positions$|^lm_head\.weight$")
normalize = keep


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    n_embd, n_head = hf_value(hf, "n_embd"), hf_value(hf, "n_head")
    head = n_embd // n_head if isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0 else 1
    # GPTJConfig's default when the key is left out is 64; a null rotates the whole head
    rotary_dim = hf_key(hf, "rotary_dim", absent=64) or head
    if not isinstance(rotary_dim, int) or rotary_dim % 2 or not 2 <= rotary_dim <= head:
        raise GptlabError(f"rotary_dim={rotary_dim!r} should be an even number of dims within a head of {head}")
    return dict(
        vocab_size=hf_value(hf, "vocab_size"),
        block_size=hf_value(hf, "n_positions", default=2048),
        n_layer=hf_value(hf, "n_layer"),
        n_head=n_head,
        n_embd=n_embd,
        mlp_hidden=hf_value(hf, "n_inner", default=4 * n_embd if isinstance(n_embd, int) else None),
        norm="layernorm",
        norm_eps=hf_value(hf, "layer_norm_epsilon", default=1e-5),
        bias=True,
        qkv_bias=False,
        attn_proj_bias=False,
        head_bias=True,
        position="rope",
        rope_base=10000.0,  # fixed in GPT-J's code
        rotary_fraction=rotary_dim / head,
        rope_interleaved=True,
        mlp="gelu",
        gelu_approximate=gelu_approximate(hf_value(hf, "activation_function", default="gelu_new")),
        block="parallel",
        shared_norm=True,
        tie_embeddings=hf_flag(hf, "tie_word_embeddings", False),
        dropout=hf_value(hf, "attn_pdrop", default=0.0),
        init_std=hf_value(hf, "initializer_range", default=0.02),
    )


def check_export(cfg: GPTConfig) -> None:
    """GPT-J has as many key/value heads as query heads and a RoPE base of 10000."""
    check_multi_head(cfg, NAME)
    if cfg.rope_base != 10000.0:
        raise unsupported_export(NAME, f"rope_base={cfg.rope_base}", "its RoPE base is fixed at 10000")


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "rotary_dim": cfg.rotary_dim,
        "n_inner": cfg.hidden_size,
        "activation_function": "gelu_new" if cfg.gelu_approximate == "tanh" else "gelu",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }


def rules(cfg: GPTConfig) -> list[Rule]:
    out = [same("transformer.wte.weight", "transformer.wte.weight")]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        out += [same(p + "ln_1.weight", p + "ln_1.weight"), same(p + "ln_1.bias", p + "ln_1.bias"),
                concatenated(p + "attn.c_attn.weight", tuple(p + f"attn.{x}_proj.weight" for x in "qkv"),
                             [cfg.n_embd] * 3),
                same(p + "attn.c_proj.weight", p + "attn.out_proj.weight")]
        for kind in ("weight", "bias"):
            out += [same(p + f"mlp.c_fc.{kind}", p + f"mlp.fc_in.{kind}"),
                    same(p + f"mlp.c_proj.{kind}", p + f"mlp.fc_out.{kind}")]
    out += [same("transformer.ln_f.weight", "transformer.ln_f.weight"),
            same("transformer.ln_f.bias", "transformer.ln_f.bias"), same("lm_head.bias", "lm_head.bias")]
    if not cfg.tie_embeddings:
        out.append(same("lm_head.weight", "lm_head.weight"))
    return out
