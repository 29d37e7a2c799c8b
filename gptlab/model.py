"""One configurable GPT: the GPT-2 family and the modern (Llama / NeoX) family, switched by `GPTConfig`.

Reads top to bottom: norms, rotary embeddings, attention (fused and manual), feed-forward, block, the model. The KV
cache for incremental decoding is an object of its own (`gptlab.kv_cache`) whose methods the forward calls.
Shapes: B batch, T sequence, C n_embd, nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptlab.config import GPTConfig
from gptlab.kv_cache import KVCache
from gptlab.ops import cross_entropy, linear


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


# ---------------------------------------------------------------------------------------------------------------------
# Rotary position embeddings (RoPE), in the "rotate half" layout that Llama and GPT-NeoX checkpoints use.
# ---------------------------------------------------------------------------------------------------------------------
def rope_tables(config: GPTConfig, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions `pos` (1 or B, T), shaped (1 or B, 1, T, rotary_dim / 2), in fp32.

    Computed per forward from the positions rather than cached in a buffer, so a bf16 model keeps fp32 angles and
    every row of a batch can sit at its own position.
    """
    rot = config.rotary_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, rot, 2, device=pos.device, dtype=torch.float32) / rot))
    angles = pos.to(torch.float32)[..., None] * inv_freq  # (B, T, rot/2)
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of x (B, n, T, hs); the rest pass through (partial rotary)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    # Trainers may set this (GPT.set_attention_dtype) to compute q/k/v, qk-norm, RoPE and attention in another
    # dtype than the surrounding matmuls: fp32 attention under bf16 is faster on CPUs, whose bf16 attention backward
    # is slow. None: the dtype the projections produce.
    attention_dtype: torch.dtype | None = None

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer  # the layer's index: its slot in a KV cache
        self.n_head, self.n_kv_head, self.head_size = config.n_head, config.n_kv_head, config.head_size
        # q, k and v in one matmul: nh query heads then nkv key heads then nkv value heads
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_size, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        manual: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, C = x.shape
        hs = self.head_size
        q, k, v = self.c_attn(x).split([self.n_head * hs, self.n_kv_head * hs, self.n_kv_head * hs], dim=-1)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        out_dtype = q.dtype
        if self.attention_dtype is not None and self.attention_dtype != out_dtype:
            q, k, v = q.to(self.attention_dtype), k.to(self.attention_dtype), v.to(self.attention_dtype)
        if self.config.qk_norm:
            q = F.rms_norm(q, (hs,), eps=self.config.norm_eps)
            k = F.rms_norm(k, (hs,), eps=self.config.norm_eps)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:  # store the new keys/values, then attend over everything cached so far
            k, v = kv_cache.append(self.layer, k, v)  # (B, nkv, T_k, hs)
            # attend in the wider of the two dtypes: a float32 cache under bf16 weights gives float32 attention
            dtype = torch.promote_types(q.dtype, k.dtype)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

        dropout_p = self.config.dropout if self.training else 0.0
        # autocast would cast SDPA's inputs back to its low-precision dtype: switch it off for an explicit dtype
        no_autocast = self.attention_dtype is not None and torch.is_autocast_enabled(x.device.type)
        with torch.autocast(x.device.type, enabled=False) if no_autocast else contextlib.nullcontext():
            if manual:
                y, weights = self._manual_attention(q, k, v, mask, dropout_p)
            else:
                weights = None
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None and T > 1,
                    enable_gqa=self.n_kv_head != self.n_head,
                )  # (B, nh, T, hs)
        y = y.to(out_dtype).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y)), weights

    def _manual_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax(q k^T / sqrt(hs) + mask) v, spelled out; also returns the weights (B, nh, T, T_k)."""
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, nh, T_k, hs)
        T, T_k = q.shape[-2], k.shape[-2]
        if mask is None:  # plain causal: query t sees keys 0..t
            mask = torch.ones(T, T_k, dtype=torch.bool, device=q.device).tril(diagonal=T_k - T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T_k)
        att = att.masked_fill(~mask, float("-inf"))
        weights = F.softmax(att.float(), dim=-1).to(q.dtype)
        y = F.dropout(weights, p=dropout_p, training=dropout_p > 0) @ v  # (B, nh, T, hs)
        return y, weights


# ---------------------------------------------------------------------------------------------------------------------
# Feed-forward
# ---------------------------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind = config.mlp
        self.gelu_approximate = config.gelu_approximate
        hidden = config.hidden_size
        # SwiGLU's gate and up projections share one matmul: c_fc outputs [gate | up]
        fc_out = 2 * hidden if self.kind == "swiglu" else hidden
        self.c_fc = nn.Linear(config.n_embd, fc_out, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.dropout(self.c_proj(h))


# ---------------------------------------------------------------------------------------------------------------------
# Block: pre-norm, post-norm or parallel residual
# ---------------------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layout = config.block
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope, mask, kv_cache, manual):  # noqa: ANN001, ANN201 - internal, see GPT.forward
        if self.layout == "pre":  # x + f(norm(x)): GPT-2, Llama
            a, w = self.attn(self.ln_1(x), rope, mask, kv_cache, manual)
            x = x + a
            x = x + self.mlp(self.ln_2(x))
        elif self.layout == "parallel":  # x + attn(norm1(x)) + mlp(norm2(x)): GPT-J, GPT-NeoX
            a, w = self.attn(self.ln_1(x), rope, mask, kv_cache, manual)
            x = x + a + self.mlp(self.ln_2(x))
        else:  # post: norm(x + f(x)), the original transformer
            a, w = self.attn(x, rope, mask, kv_cache, manual)
            x = self.ln_1(x + a)
            x = self.ln_2(x + self.mlp(x))
        return x, w


# ---------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------
class GPT(nn.Module):
    # Trainers may set this to trade compute for memory: blocks keep only their inputs for backward and run their
    # forward again there (torch.utils.checkpoint), so activations of one block at a time are held.
    activation_checkpointing: bool = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                # a post-norm block already ends in a norm, so the final norm would be redundant
                ln_f=make_norm(config) if config.block != "post" else nn.Identity(),
            )
        )
        if config.position == "learned":
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 * n_layer)."""
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):  # a tied table gets the same N(0, std) from either side
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    # --- forward -------------------------------------------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        return_attention: bool = False,
        reduction: str = "mean",
    ):  # noqa: ANN201 - (logits, loss) or (logits, loss, attentions)
        """logits (B, T, vocab) for every position, and the cross-entropy over targets that are not -1 (their mean,
        or with `reduction="sum"` their sum: a trainer averaging over a whole batch of masked targets needs sums).

        With `kv_cache`, idx holds only the new tokens of each row; they are appended to the cache. With
        `return_attention=True` the manual attention path runs and a list of (B, nh, T, T_k) weights per layer is
        returned as a third element.
        """
        h = self.hidden_states(idx, kv_cache=kv_cache, return_attention=return_attention)
        h, attentions = h if return_attention else (h, None)
        loss = None
        if targets is None:
            logits = self.logits(h)
        else:  # the loss's LM head through fp32 where this CPU lacks bf16 matmuls (`linear`); generation's
            # (`logits`) stays the module's own forward, which packed inference weights replace
            logits = self.logits(h, head=linear(h, self.lm_head.weight, self.lm_head.bias))
            loss = cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        return (logits, loss, attentions) if return_attention else (logits, loss)

    def logits(self, h: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head (with optional soft-capping) over final hidden states (..., C); `head`: lm_head(h) if
        already computed."""
        logits = self.lm_head(h) if head is None else head
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def hidden_states(
        self, idx: torch.Tensor, *, kv_cache: KVCache | None = None, return_attention: bool = False
    ):  # noqa: ANN201 - tensor, or (tensor, attentions)
        """Final-norm hidden states (B, T, C); callers that need only some positions apply `logits` to those."""
        cfg = self.config
        idx = self._check_input(idx, kv_cache)
        B, T = idx.shape
        device = idx.device
        manual = return_attention or cfg.attention == "manual"

        if kv_cache is None:
            pos = torch.arange(T, device=device)[None]  # (1, T)
            mask = None  # plain causal attention
        else:
            pos, mask = kv_cache.begin(T)  # (1 or B, T) positions; which cached keys each query sees

        x = self.transformer.wte(idx)  # (B, T, C)
        if cfg.position == "learned":
            x = x + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        rope = rope_tables(cfg, pos) if cfg.position == "rope" else None

        attentions = []
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if recompute:  # keep only each block's input; backward runs its forward again (same dropout masks)
                x, weights = checkpoint(block, x, rope, mask, kv_cache, manual, use_reentrant=False)
            else:
                x, weights = block(x, rope, mask, kv_cache, manual)
            attentions.append(weights)
        x = self.transformer.ln_f(x)
        if kv_cache is not None:
            kv_cache.advance(T)
        return (x, attentions) if return_attention else x

    def _check_input(self, idx: torch.Tensor, kv_cache: KVCache | None) -> torch.Tensor:
        """Clear ValueErrors for bad input instead of index errors deep inside torch."""
        cfg = self.config
        if not isinstance(idx, torch.Tensor):
            raise ValueError(f"token ids must be a torch.Tensor, got {type(idx).__name__}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"token ids must be an integer tensor, got dtype {idx.dtype}")
        if idx.dim() != 2:
            raise ValueError(f"token ids must have shape (batch, time), got {tuple(idx.shape)}")
        B, T = idx.shape
        if T == 0:
            raise ValueError("token ids are empty: the sequence needs at least one token")
        if kv_cache is None and T > cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size {cfg.block_size}")
        if kv_cache is not None and torch.is_grad_enabled():
            raise ValueError("a KV-cached forward is for inference: run it under torch.no_grad() or inference_mode()")
        if kv_cache is not None and kv_cache.batch_size != B:
            raise ValueError(f"the KV cache has {kv_cache.batch_size} rows but the input has {B}")
        if not torch.compiler.is_compiling():
            lo, hi = torch.aminmax(idx)
            if lo < 0 or hi >= cfg.vocab_size:
                bad = int(lo) if lo < 0 else int(hi)
                raise ValueError(f"token id {bad} is outside [0, {cfg.vocab_size}) (the model's vocab_size)")
        if cfg.position == "learned" and kv_cache is not None and int(kv_cache.lengths.max()) + T > cfg.block_size:
            raise ValueError(f"position {int(kv_cache.lengths.max()) + T - 1} is past the learned positions "
                             f"(block_size {cfg.block_size})")
        return idx if idx.dtype in (torch.int64, torch.int32) else idx.long()

    # --- parameters ------------------------------------------------------------------------------------------------
    def parameter_groups_by_kind(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """Trainable parameters by role: "embedding" (token and position tables, the tied head), "head" (an untied
        LM head), "matrix" (hidden-layer weight matrices: Muon's and weight decay's target), "vector" (biases, norm
        weights). Frozen parameters (requires_grad False, e.g. a base model under adapters) are left out."""
        kinds: dict[str, list[tuple[str, nn.Parameter]]] = {"embedding": [], "head": [], "matrix": [], "vector": []}
        for name, p in self.named_parameters():  # tied weights appear once
            if not p.requires_grad:
                continue
            component = parameter_component(name)
            if component in ("embeddings", "head"):
                kinds["embedding" if component == "embeddings" else "head"].append((name, p))
            else:
                kinds["matrix" if p.dim() >= 2 else "vector"].append((name, p))
        return kinds

    def optimizer_groups(self, weight_decay: float, decay_embeddings: bool = False) -> list[dict]:
        """AdamW parameter groups of the trainable parameters: decay on weight matrices (and optionally embeddings
        / head), none on biases and norms. Empty groups are left out."""
        kinds = self.parameter_groups_by_kind()
        decay = [p for _, p in kinds["matrix"]]
        no_decay = [p for _, p in kinds["vector"]]
        (decay if decay_embeddings else no_decay).extend(p for _, p in kinds["embedding"] + kinds["head"])
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def set_attention_dtype(self, dtype: torch.dtype | None) -> None:
        """Compute attention (and qk-norm, RoPE) in `dtype` whatever the weights' or autocast's dtype; None resets."""
        for block in self.transformer.h:
            block.attn.attention_dtype = dtype

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """All parameters (tied ones once), trainable or not; without the embedding tables if asked."""
        return sum(p.numel() for name, p in self.named_parameters()
                   if not (exclude_embeddings and parameter_component(name) == "embeddings"))

    def iter_blocks(self) -> Iterator[Block]:
        return iter(self.transformer.h)


def parameter_breakdown(config: GPTConfig) -> dict[str, int]:
    """Parameter counts by component, computed on the meta device: no memory is allocated, so any preset works.

    Components: embeddings (token + position), attention, mlp, norms, head (0 when tied: counted once, with the
    embeddings), and total.
    """
    with torch.device("meta"):
        model = GPT(config)
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():
        counts[parameter_component(name)] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


COMPONENTS = ("embeddings", "attention", "mlp", "norms", "head")


def parameter_component(name: str) -> str:
    """The component a parameter belongs to, from its name: "embeddings" (token and position tables, and a tied
    head, which is the token table), "head" (an untied LM head), "attention", "mlp", or "norms"."""
    if name.startswith(("transformer.wte", "transformer.wpe")):
        return "embeddings"
    if name.startswith("lm_head"):
        return "head"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "norms"
