"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, GELU MLP, pre-norm, biases everywhere.

gptlab's GPT-2 layout and names match transformers' one for one; the only twist is that GPT-2's `Conv1D`
layers store their weights as (in, out), the transpose of nn.Linear.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.common import Rule, check_multi_head, gelu_approximate, hf_flag, hf_value, same, transposed

NAME = "GPT-2"
ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"
# the switches (GPTConfig fields beyond common.CARRIED) GPT-2 has, and the values they may take
EXPRESSES = {"norm": ("layernorm",), "position": ("learned",), "mlp": ("gelu",), "block": ("pre",), "bias": (True,)}
# causal-mask buffers that older transformers saved with the weights, and a tied head saved anyway
IGNORE = re.compile(r"\.attn\.(bias|masked_bias)$|^lm_head\.weight$")

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_PLAIN = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
          "attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise GptlabError("GPT-2 with scale_attn_by_inverse_layer_idx=true or scale_attn_weights=false is "
                          "not supported: gptlab scales attention by 1/sqrt(head_size)")
    if hf.get("add_cross_attention"):
        raise GptlabError("GPT-2 with add_cross_attention=true is an encoder-decoder part, not supported")
    return dict(
        vocab_size=hf_value(hf, "vocab_size"),
        block_size=hf_value(hf, "n_positions", "max_position_embeddings"),
        n_layer=hf_value(hf, "n_layer", "num_hidden_layers"),
        n_head=hf_value(hf, "n_head", "num_attention_heads"),
        n_embd=hf_value(hf, "n_embd", "hidden_size"),
        mlp_hidden=hf.get("n_inner"),  # null means 4 * n_embd, as gptlab's default mlp_ratio does
        norm="layernorm",
        norm_eps=hf_value(hf, "layer_norm_epsilon", default=1e-5),
        bias=True,
        position="learned",
        mlp="gelu",
        gelu_approximate=gelu_approximate(hf_value(hf, "activation_function", default="gelu_new")),
        block="pre",
        tie_embeddings=hf_flag(hf, "tie_word_embeddings", True),
        dropout=hf_value(hf, "resid_pdrop", default=0.1),
        init_std=hf_value(hf, "initializer_range", default=0.02),
    )


def check_export(cfg: GPTConfig) -> None:
    """What EXPRESSES can't say: GPT-2 has as many key/value heads as query heads."""
    check_multi_head(cfg, NAME)


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None if cfg.hidden_size == 4 * cfg.n_embd else cfg.hidden_size,
        "activation_function": "gelu_new" if cfg.gelu_approximate == "tanh" else "gelu",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }


def normalize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints saved from the bare GPT2Model (like the original openai-community/gpt2 files) lack the
    `transformer.` prefix."""
    if any(name.startswith("transformer.") for name in tensors):
        return tensors
    return {name if name.startswith("lm_head.") else f"transformer.{name}": t for name, t in tensors.items()}


def rules(cfg: GPTConfig) -> list[Rule]:
    out = [same("transformer.wte.weight", "transformer.wte.weight"),
           same("transformer.wpe.weight", "transformer.wpe.weight")]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        out += [same(p + name, p + name) for name in _PLAIN]
        out += [transposed(p + name, p + name) for name in _CONV1D]
    out += [same("transformer.ln_f.weight", "transformer.ln_f.weight"),
            same("transformer.ln_f.bias", "transformer.ln_f.bias")]
    if not cfg.tie_embeddings:
        out.append(same("lm_head.weight", "lm_head.weight"))
    return out
