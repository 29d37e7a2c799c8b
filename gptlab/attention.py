"""Causal self-attention: q, k, v in one projection, grouped key/value heads, and two paths that agree, the fused
`scaled_dot_product_attention` and a manual one that spells the maths out (and returns the weights).

Switches that change what a head computes live here: q/k norms, RoPE's layout, the scores' scale and soft-cap,
and a sliding window (the mask for it comes from `kv_cache.Masks`). Shapes: B batch, T new tokens, T_k keys, nh
query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.causal_attention import attention as causal_attention
from gptlab.config import GPTConfig
from gptlab.heads import split_heads
from gptlab.kv_cache import KVCache, Masks
from gptlab.linear import Linear
from gptlab.rope import apply_rope

Hook = Callable[[str, torch.Tensor], torch.Tensor]


def tap(hooks: Hook | None, name: str, x: torch.Tensor) -> torch.Tensor:
    """x as the hook point `name` hands it on: unchanged unless hooks are set on this module (`gptlab.hooks` sets
    them while a caller looks inside; the check is all a forward pays otherwise)."""
    return x if hooks is None else hooks(name, x)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         dropout_p: float = 0.0) -> torch.Tensor:
    """F.scaled_dot_product_attention of queries (B, nh, T, hs) over keys and values (B, nkv, T_k, hs), `mask`
    None meaning causal (for T > 1). With one query per row (decoding) and grouped kv heads, each kv head's group
    of query heads is read as that many positions of it: the same numbers without `enable_gqa`, whose CPU path is
    several times slower in bf16, and without repeating k and v. Causal attention in bf16 training on a CPU with
    bf16 dot products takes gptlab's backward (`gptlab.causal_attention`)."""
    B, nh, T, hs = q.shape
    nkv = k.shape[1]
    if mask is None and T > 1 and dropout_p == 0.0:  # in bf16 training on a CPU: gptlab's backward
        y = causal_attention(q, k, v, scale)
        if y is not None:
            return y
    if T == 1 and nkv != nh and dropout_p == 0.0:
        y = F.scaled_dot_product_attention(q.view(B, nkv, nh // nkv, hs), k, v, attn_mask=mask, scale=scale)
        return y.reshape(B, nh, 1, hs)  # CUDA's kernels may hand back (B, nkv, g, hs) in another memory order
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=mask is None and T > 1, scale=scale, enable_gqa=nkv != nh)


class CausalSelfAttention(nn.Module):
    # Trainers may set this (GPT.set_attention_dtype) to compute q/k/v, qk-norm, RoPE and attention in another
    # dtype than the surrounding matmuls: fp32 attention under bf16 is faster on CPUs, whose bf16 attention backward
    # is slow. None: the dtype the projections produce.
    attention_dtype: torch.dtype | None = None
    # hook points (q/k/v, scores, pattern, z), set by `gptlab.hooks` while a caller looks inside; `needs_pattern`
    # (true on the threads whose hooks read the scores or the pattern, which only the manual path computes)
    hooks: Hook | None = None
    needs_pattern: bool = False

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer  # the layer's index: its slot in a KV cache
        self.n_head, self.n_kv_head, self.head_size = config.n_head, config.n_kv_head, config.head_size
        self.sliding = config.sliding_layer(layer)
        self.scale = config.attn_scale if config.attn_scale is not None else 1.0 / math.sqrt(self.head_size)
        # q, k and v in one matmul: nh query heads then nkv key heads then nkv value heads
        qkv = (self.n_head + 2 * self.n_kv_head) * self.head_size
        self.c_attn = Linear(config.n_embd, qkv, bias=config.has_bias("qkv"))
        self.c_proj = Linear(self.n_head * self.head_size, config.n_embd, bias=config.has_bias("attn_proj"))
        if config.qk_norm_weight:  # learned per-dim scales of the q and k norms (Qwen3)
            self.q_norm = nn.RMSNorm(self.head_size, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_size, eps=config.norm_eps)
        self.resid_dropout = nn.Dropout(config.dropout)
        # the attention weights' dropout, applied inside SDPA (or the manual path): never called, its p read in
        # forward, so that whatever sets every nn.Dropout's p (an init_from dropout override, disable_dropout)
        # reaches it too without touching the config a checkpoint saves
        self.attn_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        masks: Masks,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        hs, cfg = self.head_size, self.config
        qkv, hooks = self.c_attn(x), self.hooks
        heads = None if hooks is not None or cfg.qk_norm_weight else split_heads(
            qkv, self.n_head, self.n_kv_head, rope, cfg.rope_interleaved, cfg.norm_eps if cfg.qk_norm else None,
            self.attention_dtype or qkv.dtype)
        q, k, v = heads if heads is not None else self._heads(qkv, rope)  # the kernel: training on a CPU
        out_dtype = qkv.dtype
        if kv_cache is not None:  # store the new keys/values, then attend over everything cached so far
            k, v = kv_cache.append(self.layer, k, v)  # (B, nkv, T_k, hs)
            # attend in the wider of the two dtypes: a float32 cache under bf16 weights gives float32 attention
            dtype = torch.promote_types(q.dtype, k.dtype)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

        mask = masks.window if self.sliding else masks.full
        dropout_p = self.attn_dropout.p if self.training else 0.0
        # autocast would cast SDPA's inputs back to its low-precision dtype: switch it off for an explicit dtype
        no_autocast = self.attention_dtype is not None and torch.is_autocast_enabled(x.device.type)
        with torch.autocast(x.device.type, enabled=False) if no_autocast else contextlib.nullcontext():
            if cfg.attention == "manual" or cfg.attn_softcap is not None or self.needs_pattern:  # SDPA: no soft-cap
                y, _ = self._manual_attention(q, k, v, mask, dropout_p, hooks)
            else:
                y = sdpa(q, k, v, mask, self.scale, dropout_p)  # (B, nh, T, hs)
        # (B, T, nh, hs): each head's output; cast and laid out in one copy
        y = tap(hooks, "hook_z", y.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format))
        y = y.contiguous().view(B, T, self.n_head * hs)
        return self.resid_dropout(self.c_proj(y))

    def _heads(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, hs), k and v (B, nkv, T, hs) from the projection's output qkv (B, T, (nh + 2 nkv) hs): cut
        into heads, cast to the attention's dtype, q and k normalized (QK-norm) and rotated (RoPE)."""
        B, T, _ = qkv.shape
        hs, cfg, hooks = self.head_size, self.config, self.hooks
        q, k, v = qkv.split([self.n_head * hs, self.n_kv_head * hs, self.n_kv_head * hs], dim=-1)
        q = tap(hooks, "hook_q", q.view(B, T, self.n_head, hs)).transpose(1, 2)  # (B, nh, T, hs)
        k = tap(hooks, "hook_k", k.view(B, T, self.n_kv_head, hs)).transpose(1, 2)  # (B, nkv, T, hs)
        v = tap(hooks, "hook_v", v.view(B, T, self.n_kv_head, hs)).transpose(1, 2)  # (B, nkv, T, hs)
        if self.attention_dtype is not None and self.attention_dtype != q.dtype:
            q, k, v = q.to(self.attention_dtype), k.to(self.attention_dtype), v.to(self.attention_dtype)
        if cfg.qk_norm_weight:
            q, k = self.q_norm(q), self.k_norm(k)
        elif cfg.qk_norm:
            q, k = F.rms_norm(q, (hs,), eps=cfg.norm_eps), F.rms_norm(k, (hs,), eps=cfg.norm_eps)
        if rope is not None:
            q, k = apply_rope(q, *rope, cfg.rope_interleaved), apply_rope(k, *rope, cfg.rope_interleaved)
            if hooks is not None:  # (B, T, heads, hs) as hook_q / hook_k
                q = hooks("hook_rot_q", q.transpose(1, 2)).transpose(1, 2)
                k = hooks("hook_rot_k", k.transpose(1, 2)).transpose(1, 2)
        return q, k, v

    def _manual_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
        hooks: Hook | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax(cap * tanh(q k^T * scale / cap) + mask) v, spelled out (no cap unless set); also returns the
        weights (B, nh, T, T_k)."""
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, nh, T_k, hs)
        T, T_k = q.shape[-2], k.shape[-2]
        if mask is None:  # plain causal: query t sees keys 0..t
            mask = torch.ones(T, T_k, dtype=torch.bool, device=q.device).tril(diagonal=T_k - T)
        att = (q @ k.transpose(-2, -1)) * self.scale  # (B, nh, T, T_k)
        if self.config.attn_softcap is not None:
            cap = self.config.attn_softcap
            att = cap * torch.tanh(att / cap)
        att = tap(hooks, "hook_attn_scores", att.masked_fill(~mask, float("-inf")))
        weights = tap(hooks, "hook_pattern", F.softmax(att.float(), dim=-1).to(q.dtype))
        y = F.dropout(weights, p=dropout_p, training=dropout_p > 0) @ v  # (B, nh, T, hs)
        return y, weights
