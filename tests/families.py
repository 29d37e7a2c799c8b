"""Tiny models of every family gptlab builds (GPT-2, Llama, Qwen2/3, Mistral, Gemma 2, Phi-3, GPT-J, scaled RoPE), for
the tests that run one check across all of them. Import as `from families import ALL_FAMILIES, model_of`
(`FAMILIES`, `build`: the RoPE families alone, with overrides)."""

from __future__ import annotations

import torch
import torch.nn as nn
from helpers import tiny_model

from gptlab import GPT, GPTConfig
from gptlab.config import RopeScaling

VOCAB, BLOCK = 97, 48
_LLAMA = dict(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
              tie_embeddings=False)
FAMILIES: dict[str, dict] = {
    "llama": _LLAMA,
    "qwen2": dict(_LLAMA, qkv_bias=True),
    "qwen3": dict(_LLAMA, n_embd=32, qk_norm=True, qk_norm_weight=True, head_dim=16),  # 4 heads of 16 in width 32
    "mistral": dict(_LLAMA, n_layer=3, sliding_window=5),
    "gemma2": dict(norm="rmsnorm", norm_unit_offset=True, scale_embeddings=True, bias=False, position="rope",
                   mlp="geglu", block="sandwich", attn_softcap=50.0, logit_softcap=30.0, sliding_window=5,
                   global_layer_every=2, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, head_dim=16,
                   attn_scale=12 ** -0.5, tie_embeddings=True),
    "phi3": dict(_LLAMA, rotary_fraction=0.5, sliding_window=7),
    "gptj": dict(norm="layernorm", bias=True, position="rope", mlp="gelu", block="parallel", shared_norm=True,
                 rope_interleaved=True, rotary_fraction=0.25, head_bias=True, qkv_bias=False, attn_proj_bias=False,
                 n_layer=2, n_head=4, n_embd=64, tie_embeddings=False),
    "llama-yarn": dict(_LLAMA, rope_scaling=RopeScaling("yarn", factor=4.0, original_context=16)),
    "llama-llama3": dict(_LLAMA, rope_scaling=RopeScaling("llama3", factor=8.0, original_context=16,
                                                          low_freq_factor=1.0, high_freq_factor=4.0)),
}


def config(family: str, **overrides) -> GPTConfig:
    return GPTConfig(**{"vocab_size": VOCAB, "block_size": BLOCK, "init_std": 0.1, **FAMILIES[family], **overrides})


def build(family: str, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config(family, **overrides)).eval()
    with torch.no_grad():  # move every weight off its init (norm weights of 1 or 0, zero biases)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def gpt2_like(**kw: object) -> nn.Module:
    """A tiny model of the GPT-2 family: pre-norm LayerNorm blocks, GELU MLP, learned positions."""
    kw = {"n_kv_head": None, "mlp": "gelu", **kw}
    return tiny_model(position="learned", vocab_size=VOCAB, norm="layernorm", bias=True, **kw)


ALL_FAMILIES = ["gpt2", *FAMILIES]


def model_of(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return (gpt2_like() if family == "gpt2" else build(family)).to(dtype)
