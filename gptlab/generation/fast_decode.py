"""A lean decode step for GPT-2-shaped models: the same maths as `GPT.hidden_states` for one new token per row,
with the framework time taken out.

At batch 1 a decode step is mostly reading weights (~250 MB for GPT-2 124M in bf16, ~13 ms on a 2-core Zen 3),
but the general forward adds about as much again in Python and small ops: module calls, dropout and dtype
switches, q/k/v reshapes and casts, checks of the token ids, per layer. This step does only what a pre-norm
LayerNorm/GELU model with learned positions needs for T = 1, in a flat loop:

    x = wte[token] + wpe[pos]
    per layer: x += c_proj(attention(split(c_attn(ln_1(x))), cache));  x += mlp(ln_2(x))
    ln_f(x)

The Linear layers are still called as modules, so whatever forward they have (packed weights, LoRA, a quantized
Linear) runs unchanged; the KV cache's own `begin` / `append` / `advance` place keys and masks. `supports` picks
the models it is exact for (the GPT-2 family, in eval mode or without dropout); tests compare its hidden states
and greedy tokens with the plain forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.attention import CausalSelfAttention
from gptlab.generation.packed_linear import avx2_packed
from gptlab.kernels import avx2_ops
from gptlab.kv_cache import KVCache, Masks
from gptlab.model import GPT, MLP, Block
from gptlab.quantize import QuantizedLinear


def supports(model: GPT) -> bool:
    """Whether `decode_hidden` computes exactly what `model.hidden_states` does for this model."""
    cfg = model.config
    plain = (
        cfg.block == "pre" and cfg.norm == "layernorm" and not cfg.norm_unit_offset and cfg.position == "learned"
        and cfg.mlp == "gelu" and not (cfg.qk_norm or cfg.qk_norm_weight) and cfg.attn_softcap is None
        and cfg.sliding_window is None and cfg.attention == "sdpa" and not cfg.scale_embeddings
        and not cfg.embedding_norm and (cfg.dropout == 0 or not model.training)
    )
    return plain and type(model.transformer.ln_f) is nn.LayerNorm and all(
        type(b) is Block and type(b.attn) is CausalSelfAttention and type(b.mlp) is MLP
        and type(b.ln_1) is nn.LayerNorm and type(b.ln_2) is nn.LayerNorm and b.attn.attention_dtype is None
        and b.attn.n_kv_head == b.attn.n_head  # q, k, v of equal width (no grouped heads)
        for b in model.transformer.h
    )


def _norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _native_weights(model: GPT) -> list[torch.Tensor | None] | None:
    """Every block's norms and (packed weight, qparams, bias) per Linear in `gpt2_decode`'s order, when all its
    Linears run through gptlab's AVX2 kernel right now (plain ones inside `PackedLinears.active()`, int8/int4 ones,
    `QuantizedLinear`, on a CPU where that is their forward) and every norm has ln_f's epsilon; None otherwise.
    Built every step (the packs may change between steps), so submodules and parameters are read from `_modules`
    / `_parameters` directly: nn.Module's attribute lookup made this ~5% of a batch-1 step."""
    out: list[torch.Tensor | None] = []
    eps = model.transformer.ln_f.eps  # the C++ step takes one epsilon for every norm
    for b in model.transformer.h:
        parts = b._modules
        attn, mlp = parts["attn"]._modules, parts["mlp"]._modules
        halves = (parts["ln_1"], (attn["c_attn"], attn["c_proj"])), (parts["ln_2"], (mlp["c_fc"], mlp["c_proj"]))
        for ln, linears in halves:
            if ln.eps != eps:
                return None
            out += [ln._parameters["weight"], ln._parameters["bias"]]
            for lin in linears:
                if isinstance(lin, QuantizedLinear):
                    weights = lin.avx2_weights()
                else:
                    packed = avx2_packed(lin)
                    weights = None if packed is None else (packed, None)
                if weights is None:
                    return None
                out += [*weights, lin._parameters["bias"]]
    return out


def _native_step(model: GPT, x: torch.Tensor, cache: KVCache, masks: Masks, weights: list) -> torch.Tensor:
    """The blocks of `decode_hidden` in one C++ call (`gpt2_decode` in gptlab/kernels/decode_avx2.cpp)."""
    a, cfg = model.transformer.h[0].attn, model.config
    where = cache._where
    rows, pos = (None, None) if isinstance(where, int) else where
    return avx2_ops().gpt2_decode(
        x, weights, cache.k, cache.v, where if isinstance(where, int) else -1, rows, pos, cache._end, masks.full,
        a.n_head, a.head_size, model.transformer.h[0].mlp.c_fc.out_features, model.transformer.ln_f.eps, a.scale,
        cfg.gelu_approximate)


def decode_hidden(model: GPT, idx: torch.Tensor, cache: KVCache, native: bool = True) -> torch.Tensor:
    """Final-norm hidden states (B, 1, C) of one new token per row (idx (B, 1)), appended to `cache`: what
    `model.hidden_states(idx, kv_cache=cache)` returns, for a model `supports` accepts. With `native` and every
    Linear on gptlab's AVX2 kernel, the blocks run as one C++ call doing the same ops."""
    B = idx.shape[0]
    t = model.transformer
    pos, masks = cache.begin(1)  # (1 or B, 1); a mask only when rows differ in length
    x = t.wte(idx) + t.wpe(pos)  # (B, 1, C)
    weights = _native_weights(model) if native else None
    if weights is not None:
        x = _native_step(model, x, cache, masks, weights)
        cache.advance(1)
        return _norm(t.ln_f, x)
    for layer, block in enumerate(t.h):
        a = block.attn
        nh, hs = a.n_head, a.head_size
        # (B, 1, 3 * nh * hs) -> q, k, v (B, nh, 1, hs): views of the one projection
        q, k, v = a.c_attn(_norm(block.ln_1, x)).view(B, 3, nh, 1, hs).unbind(1)
        k, v = cache.append(layer, k, v)  # (B, nh, T_k, hs), in the cache's dtype
        y = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=masks.full, scale=a.scale)
        x = x + a.c_proj(y.to(x.dtype).view(B, 1, nh * hs))  # (B, nh, 1, hs) is laid out as (B, 1, nh * hs)
        m = block.mlp
        x = x + m.c_proj(F.gelu(m.c_fc(_norm(block.ln_2, x)), approximate=m.gelu_approximate))
    cache.advance(1)
    return _norm(t.ln_f, x)
