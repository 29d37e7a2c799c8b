"""A lean decode step for every model gptlab builds: the same maths as `GPT.hidden_states` for one new token per
row, with the framework time taken out.

At batch 1 a decode step is mostly reading weights, but the general forward adds a good share again in Python
and small ops: module calls, dropout, checks of the token ids, q/k/v transposes, per layer (a Llama-shaped model
of 30 layers pays it 30 times). This step reads the model's config once and runs, for T = 1 in a flat loop, only
the ops the config asks for:

    x = embed(token) (token shift) (+ wpe[pos]);  rope = cos/sin at the rows' positions
    per layer (pre-norm; parallel and sandwich alike):
        q, k, v = split(c_attn(norm_1(x)));  q/k norm;  rotate q, k;  cache k, v
        x += c_proj(attention(q, keys, values));  x += mlp(norm_2(x) (token shift))
    norm_f(x)

(token shift: a vector mixed with the previous position's, which the KV cache keeps: `KVCache.previous`.)

The Linear layers are called as modules, so whatever forward they have (packed weights, LoRA, a quantized Linear)
runs unchanged; the KV cache's own `begin` / `append` / `advance` place keys and masks. Where every Linear runs on
gptlab's own kernel, the blocks run as one C++ call instead (`gptlab.generation.native_decode`).

`lean_step_exact` is safe by default: the step names the config switches it computes (`LEAN_SWITCHES`); a model whose
config sets any other field away from its default (a switch added to `GPTConfig` later) takes the plain forward.
Tests compare its hidden states (to the bit) and greedy tokens with the plain forward, family by family.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.attention import CausalSelfAttention, sdpa
from gptlab.config import GPTConfig
from gptlab.generation import native_decode
from gptlab.hooks import hooked_here
from gptlab.kernels.dispatch import BATCH
from gptlab.kv_cache import KVCache, Masks
from gptlab.model import GPT, MLP, Block
from gptlab.norms import LayerNorm, RMSNorm, UnitOffsetRMSNorm
from gptlab.rope import apply_rope, rope_at
from gptlab.token_shift import TokenShift

# The GPTConfig fields this step reads, at any value; any other field must be at its default for `lean_step_exact`.
LEAN_SWITCHES = frozenset({
    "vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "head_dim",
    "norm", "norm_eps", "norm_weight", "norm_unit_offset", "embedding_norm", "scale_embeddings",
    "bias", "qkv_bias", "attn_proj_bias", "norm_bias", "head_bias",
    "position", "rope_base", "rotary_fraction", "rope_interleaved", "rope_scaling",
    "mlp", "gelu_approximate", "mlp_hidden", "mlp_ratio", "mlp_multiple",
    "block", "shared_norm",
    "qk_norm", "qk_norm_weight", "attn_scale", "attn_softcap", "sliding_window", "global_layer_every",
    "token_shift",
    "tie_embeddings", "logit_softcap", "attention", "dropout",  # the head's and training's: not the step's
    "init_std", "scale_residual_init", "name", "hf_architecture",
})
NORMS = (nn.LayerNorm, nn.RMSNorm, LayerNorm, RMSNorm, UnitOffsetRMSNorm, nn.Identity)


def unknown_switches(config: GPTConfig) -> list[str]:
    """Fields of `config` outside LEAN_SWITCHES that are not at their defaults: what the step would ignore."""
    default = GPTConfig()
    return [f.name for f in dataclasses.fields(config)
            if f.name not in LEAN_SWITCHES and getattr(config, f.name) != getattr(default, f.name)]


def lean_step_exact(model: GPT) -> bool:
    """Whether `decode_hidden` computes exactly what `model.hidden_states` does for this model: its config sets
    only switches the step knows, it is in eval mode (or has no dropout), and its modules are gptlab's own
    classes (a replaced block, attention or norm may compute something else), and no hook point is set on it
    (`gptlab.hooks`: the hooks run in the plain forward)."""
    cfg = model.config
    if unknown_switches(cfg) or (cfg.dropout and model.training) or hooked_here(model):
        return False
    t = model.transformer
    norms = [t.ln_f, *([t.ln_emb] if cfg.embedding_norm else [])]
    if cfg.token_shift and any(type(s) is not TokenShift for s in [t.shift, *(b.mlp_shift for b in t.h)]):
        return False
    for b in t.h:
        if type(b) is not Block or type(b.attn) is not CausalSelfAttention or type(b.mlp) is not MLP:
            return False
        if b.attn.attention_dtype is not None:
            return False
        norms += [b.ln_1, *([] if cfg.shared_norm else [b.ln_2])]
        if cfg.block == "sandwich":
            norms += [b.ln_attn_out, b.ln_mlp_out]
    return all(type(n) in NORMS for n in norms)


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm module's forward, as a function (what nn.LayerNorm / nn.RMSNorm call, without the module call)."""
    kind = type(module)
    if kind in (nn.LayerNorm, LayerNorm):
        return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)
    if kind in (nn.RMSNorm, RMSNorm):
        return F.rms_norm(x, module.normalized_shape, module.weight, module.eps)
    return module(x)  # unit-offset RMSNorm (computes in fp32), Identity


def _mlp(b: Block, h: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Block._mlp without the MLP's dropout: a token-shift model's input mixed with the previous position's first."""
    if b.attn.config.token_shift:
        h = b.mlp_shift(h, cache.previous(b.layer + 1, h))
    m = b.mlp
    return m.c_proj(m.activate(m.c_fc(h)))


def _attention(a: CausalSelfAttention, x: torch.Tensor, rope, masks, cache: KVCache) -> torch.Tensor:  # noqa: ANN001
    """CausalSelfAttention.forward for one token per row (B, 1, C), in eval mode."""
    B, cfg, hs = x.shape[0], a.config, a.head_size
    nh, nkv = a.n_head, a.n_kv_head
    q, k, v = a.c_attn(x).split([nh * hs, nkv * hs, nkv * hs], dim=-1)
    q, k, v = q.view(B, nh, 1, hs), k.view(B, nkv, 1, hs), v.view(B, nkv, 1, hs)  # T = 1: no transpose needed
    out_dtype = q.dtype
    if cfg.qk_norm_weight:
        q, k = norm(a.q_norm, q), norm(a.k_norm, k)
    elif cfg.qk_norm:
        q, k = F.rms_norm(q, (hs,), eps=cfg.norm_eps), F.rms_norm(k, (hs,), eps=cfg.norm_eps)
    if rope is not None:
        q, k = apply_rope(q, *rope, cfg.rope_interleaved), apply_rope(k, *rope, cfg.rope_interleaved)
    k, v = cache.append(a.layer, k, v)  # (B, nkv, T_k, hs), in the cache's dtype
    dtype = torch.promote_types(q.dtype, k.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask = masks.window if a.sliding else masks.full
    if cfg.attention == "manual" or cfg.attn_softcap is not None:
        y, _ = a._manual_attention(q, k, v, mask, 0.0)
    else:
        y = sdpa(q, k, v, mask, a.scale)
    return a.c_proj(y.to(out_dtype).reshape(B, 1, nh * hs))  # (B, nh, 1, hs) read as (B, 1, nh * hs)


def _block(b: Block, x: torch.Tensor, rope, masks, cache: KVCache) -> torch.Tensor:  # noqa: ANN001
    """Block.forward for one token per row, without dropout or the attention weights."""
    if b.layout == "pre":
        x = x + _attention(b.attn, norm(b.ln_1, x), rope, masks, cache)
        return x + _mlp(b, norm(b.ln_2, x), cache)
    if b.layout == "parallel":
        h = norm(b.ln_1, x)
        m = _mlp(b, h if b.shared_norm else norm(b.ln_2, x), cache)
        return x + _attention(b.attn, h, rope, masks, cache) + m
    if b.layout == "sandwich":
        x = x + norm(b.ln_attn_out, _attention(b.attn, norm(b.ln_1, x), rope, masks, cache))
        return x + norm(b.ln_mlp_out, _mlp(b, norm(b.ln_2, x), cache))
    x = norm(b.ln_1, x + _attention(b.attn, x, rope, masks, cache))  # post
    return norm(b.ln_2, x + _mlp(b, x, cache))


def embed(model: GPT, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The first block's input (B, T, C) for tokens idx at positions pos, as `GPT.hidden_states` makes it (a
    token-shift model's embeddings mixed with the previous position's, kept in `cache`)."""
    cfg, t = model.config, model.transformer
    x = t.wte(idx)
    if cfg.scale_embeddings:
        x = x * torch.tensor(math.sqrt(cfg.n_embd), dtype=x.dtype)
    if cfg.token_shift:
        x = t.shift(x, cache.previous(0, x))
    if cfg.position == "learned":
        x = x + t.wpe(pos)
    if cfg.embedding_norm:
        x = norm(t.ln_emb, x)
    return x


def decode_hidden(
    model: GPT, idx: torch.Tensor, cache: KVCache, native: bool | native_decode.NativeWeights | None = True,
    keys: int | None = None,
) -> torch.Tensor:
    """Final-norm hidden states (B, 1, C) of one new token per row (idx (B, 1)), appended to `cache`: what
    `model.hidden_states(idx, kv_cache=cache)` returns, for a model `lean_step_exact` accepts. With `native` and every
    Linear on gptlab's own kernel, the blocks run as one C++ call doing the same maths (`native` may be the C++
    step's weights, gathered once by the caller: `native_decode.weights`; None or False: the Python step).
    With `keys` (a bound on the rows' lengths + 1, see `KVCache.begin`) the step reads nothing back from the
    device and its shapes are fixed: what `gptlab.generation.graph_decode` captures."""
    return _one_token(model, idx, cache, native, keys)


def decode_logits(model: GPT, idx: torch.Tensor, cache: KVCache, native: native_decode.NativeWeights | None,
                  rows: list[int] | None = None) -> torch.Tensor:
    """The logits (R, V) after the new token of rows `rows` (None: every row) of a `decode_hidden` step: what
    `model.logits(decode_hidden(...)[rows, -1])` gives, the LM head inside the C++ call where it runs on the
    step's build (and fewer rows than the dispatch's large-batch size ask for it: there PyTorch's product may be the
    one chosen)."""
    n = idx.shape[0] if rows is None else len(rows)
    if native is None or native.head is None or n >= BATCH:
        h = _one_token(model, idx, cache, native, None)
        return model.logits(h[:, -1] if rows is None else h[rows, -1])
    head_rows = None if rows is None else torch.tensor(rows)
    return model.softcap_logits(_one_token(model, idx, cache, native, None, logits=True, head_rows=head_rows))


def decode_greedy(model: GPT, token: int, cache: KVCache, native: native_decode.NativeWeights,
                  steps: int) -> list[int] | None:
    """`steps` tokens after feeding `token` to a one-row cache, each the argmax of the LM head's raw output (the
    soft-cap keeps the order) after the one before, fed in turn, in one C++ call (a draft model's guesses: `steps`
    decode steps and no Python between them); the cache holds the fed tokens after it. None where that call cannot
    run: no head on the step's build, a token embedded outside it, a sliding window (masks), no room."""
    cfg = model.config
    if (native.head is None or native.front is None or cfg.sliding_window is not None or cache.batch_size != 1
            or int(cache.lengths[0]) + steps > cache.max_len):
        return None
    pos, _ = cache.begin(steps)  # (1, steps): the steps' positions; no masks, each step attends to what it holds
    rope = rope_at(cfg, pos, cache.step_target()[1]) if cfg.position == "rope" else None
    picks = native_decode.step(model, torch.tensor([[token]]), rope, Masks(None, None), cache, native,
                               logits=True, greedy_steps=steps)
    cache.advance(steps)
    return picks[0].tolist()


def _one_token(model: GPT, idx: torch.Tensor, cache: KVCache, native: bool | native_decode.NativeWeights | None,
               keys: int | None, logits: bool = False, head_rows: torch.Tensor | None = None) -> torch.Tensor:
    """decode_hidden's step; with `logits` (the C++ step, with a head) its raw logits of rows `head_rows` (None:
    all) instead."""
    cfg, t = model.config, model.transformer
    pos, masks = cache.begin(1, cfg.sliding_window, keys)  # (1 or B, 1); masks when rows differ or a window cuts
    rope = rope_at(cfg, pos, cache.step_target()[1]) if cfg.position == "rope" else None
    weights = native_decode.weights(model, cache) if native is True else native or None
    if weights is not None:  # the tokens embedded in the call, where it can (else x (B, 1, C))
        x = idx if weights.front is not None else embed(model, idx, pos, cache)
        x = native_decode.step(model, x, rope, masks, cache, weights, head_rows, logits)  # the final norm included
    else:
        x = embed(model, idx, pos, cache)  # (B, 1, C)
        for block in t.h:
            x = _block(block, x, rope, masks, cache)
        x = norm(t.ln_f, x)
    cache.advance(1)
    return x


def decode_rows(model: GPT, cache: KVCache, slots: list[int], positions: list[int], tokens: list[int],
                weights: native_decode.NativeWeights, logits: bool = False) -> torch.Tensor:
    """Final-norm hidden states (R, C) of tokens[i] at positions[i] of cache row slots[i], written to `cache`, in
    one call of the C++ step: running rows' new tokens and prompts' next parts together (a prompt's tokens are
    rows of its slot at successive positions, each attending to those before it). The caller moves each slot's
    length on. For a model `lean_step_exact` accepts whose rotary frequencies do not depend on the length. With
    `logits` (where `weights.head`): every row's logits (R, V) instead."""
    device = cache.lengths.device
    slot_t, pos = torch.tensor(slots, device=device), torch.tensor(positions, device=device)
    masks = cache.begin_rows(slot_t, pos, model.config.sliding_window)
    pos = pos[:, None]  # (R, 1)
    ids = torch.tensor(tokens, device=device)[:, None]
    x = ids if weights.front is not None else embed(model, ids, pos, cache)  # (R, 1) or (R, 1, C)
    rope = rope_at(model.config, pos, cache.step_target()[1]) if model.config.position == "rope" else None
    if logits and weights.head is not None:
        return model.softcap_logits(native_decode.step(model, x, rope, masks, cache, weights, logits=True))
    h = native_decode.step(model, x, rope, masks, cache, weights)[:, 0]
    return model.logits(h) if logits else h
