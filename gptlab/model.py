"""One configurable GPT: the GPT-2 family and the modern (Llama / NeoX) family, switched by `GPTConfig`.

Reads top to bottom: feed-forward, block, the model. Attention (fused and manual paths) is in
`gptlab.attention`, rotary embeddings in `gptlab.rope`, and the KV cache for incremental decoding is an object of
its own (`gptlab.kv_cache`) whose methods the forward calls.
Shapes: B batch, T sequence, C n_embd, nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptlab.attention import CausalSelfAttention, Hook, tap
from gptlab.config import GPTConfig
from gptlab.head_loss import TiedGradient, head_cross_entropy, tied_embedding, tied_gradient
from gptlab.kv_cache import KVCache, document_masks, masks_for
from gptlab.linear import Linear
from gptlab.norms import UnitOffsetRMSNorm, make_norm
from gptlab.ops import (
    assert_in_range_on_device,
    check_targets_like,
    cross_entropy,
    gelu,
    reduce_losses,
    upcasting_linear,
)
from gptlab.rope import rope_tables
from gptlab.token_shift import Shifts, TokenShift


# ---------------------------------------------------------------------------------------------------------------------
# Feed-forward
# ---------------------------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    hooks: Hook | None = None  # hook_pre (hook_pre_linear: a gated MLP's up half), hook_post; see `gptlab.hooks`

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind, self.gated = config.mlp, config.gated_mlp
        self.gelu_approximate = config.gelu_approximate
        hidden = config.hidden_size
        # a gated MLP's (SwiGLU, GeGLU) gate and up projections share one matmul: c_fc outputs [gate | up]
        fc_out = 2 * hidden if config.gated_mlp else hidden
        self.c_fc = Linear(config.n_embd, fc_out, bias=config.has_bias("mlp"))
        self.c_proj = Linear(hidden, config.n_embd, bias=config.has_bias("mlp"))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        h = self.activate(h) if self.hooks is None else self._hooked_activate(h, self.hooks)
        return self.dropout(self.c_proj(h))

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The nonlinearity over c_fc's output (a gated one halves the width: [gate | up] -> act(gate) * up)."""
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.nonlinearity(gate) * up
        return self.nonlinearity(h)

    def nonlinearity(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(h)
        if self.kind == "relu2":
            return F.relu(h).square()
        return gelu(h, approximate=self.gelu_approximate)  # gelu, geglu

    def _hooked_activate(self, h: torch.Tensor, hooks: Hook) -> torch.Tensor:
        """`activate` through the hook points: the pre-activation (a gated MLP's gate, and its up half), the
        activation."""
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            post = self.nonlinearity(hooks("hook_pre", gate)) * hooks("hook_pre_linear", up)
        else:
            post = self.nonlinearity(hooks("hook_pre", h))
        return hooks("hook_post", post)


# ---------------------------------------------------------------------------------------------------------------------
# Block: pre-norm, post-norm or parallel residual
# ---------------------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    hooks: Hook | None = None  # the residual stream's hook points; see `gptlab.hooks`

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layout, self.shared_norm = config.block, config.shared_norm
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        if not config.shared_norm:  # a shared-norm parallel block reads ln_1 for both branches
            self.ln_2 = make_norm(config)
        if self.layout == "sandwich":  # norms of the branches' outputs too
            self.ln_attn_out = make_norm(config)
            self.ln_mlp_out = make_norm(config)
        self.mlp = MLP(config)
        self.layer = layer
        if config.token_shift:  # the MLP's input mixed with the previous position's (`gptlab.token_shift`)
            self.mlp_shift = TokenShift(config.n_embd)

    def forward(self, x, rope, masks, kv_cache, shifts=None):  # noqa: ANN001, ANN201 - internal, see GPT.forward
        hooks = self.hooks
        x = tap(hooks, "hook_resid_pre", x)
        if self.layout == "parallel":  # x + attn(norm1(x)) + mlp(norm2(x)): GPT-NeoX; one norm for both: GPT-J
            h = self.ln_1(x)
            a = self.attn(h, rope, masks, kv_cache)
            m = self._mlp(h if self.shared_norm else self.ln_2(x), shifts)
            x = x + tap(hooks, "hook_attn_out", a) + tap(hooks, "hook_mlp_out", m)
            return tap(hooks, "hook_resid_post", x)
        post = self.layout == "post"  # post: norm(x + f(x)), the original transformer; else x + f(norm(x))
        a = self.attn(x if post else self.ln_1(x), rope, masks, kv_cache)
        if self.layout == "sandwich":  # x + norm(f(norm(x))): Gemma 2
            a = self.ln_attn_out(a)
        x = x + tap(hooks, "hook_attn_out", a)
        x = tap(hooks, "hook_resid_mid", self.ln_1(x) if post else x)
        m = self._mlp(x if post else self.ln_2(x), shifts)
        if self.layout == "sandwich":
            m = self.ln_mlp_out(m)
        x = x + tap(hooks, "hook_mlp_out", m)
        return tap(hooks, "hook_resid_post", self.ln_2(x) if post else x)

    def _mlp(self, h: torch.Tensor, shifts: Shifts | None) -> torch.Tensor:
        if shifts is not None:
            h = self.mlp_shift(h, shifts.previous(self.layer + 1, h))
        return self.mlp(h)


# ---------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------
def embedding(num: int, dim: int, init: bool) -> nn.Embedding:
    """nn.Embedding, left uninitialized (its own N(0, 1) init skipped) when `init` is False."""
    return nn.Embedding(num, dim) if init else nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class ModelOutput(NamedTuple):
    """What `GPT.forward` returns: `logits, loss = model(idx, targets)` unpacks it."""

    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None  # a 0-dim tensor (or per target with reduction="none"); None without targets


class GPT(nn.Module):
    # Trainers may set this to trade compute for memory: blocks keep only their inputs for backward and run their
    # forward again there (torch.utils.checkpoint), so activations of one block at a time are held.
    activation_checkpointing: bool = False
    # the model's own hook points (embeddings, final norm, logits), set by `gptlab.hooks`; a model with any hook
    # set has this set too, which sends generation through the plain forward
    hooks: Hook | None = None

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):  # a dict or a preset's name failed as "no attribute 'validate'"
            raise ValueError(f"GPT takes a GPTConfig (GPTConfig.preset(name), GPTConfig.from_dict(d)), got "
                             f"{type(config).__name__}")
        config.validate()
        self.config = config
        # Built on the meta device (shapes only, for weights loaded next), nothing is initialized: meta tensors
        # hold no values, and normal_'s meta kernel would import torch._dynamo (over a second of start-up).
        init = torch.get_default_device().type != "meta"
        self.transformer = nn.ModuleDict(
            dict(
                wte=embedding(config.vocab_size, config.n_embd, init),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                # a post-norm block already ends in a norm, so the final norm would be redundant
                ln_f=make_norm(config) if config.block != "post" else nn.Identity(),
            )
        )
        if config.position == "learned":
            self.transformer["wpe"] = embedding(config.block_size, config.n_embd, init)
        if config.embedding_norm:
            self.transformer["ln_emb"] = make_norm(config)
        if config.token_shift:
            self.transformer["shift"] = TokenShift(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if init:
            self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 * n_layer) (unless
        `scale_residual_init` is off); norms scale by 1 (a unit-offset norm's weight is 0)."""
        with torch.no_grad():
            for param, init in self.initializers():
                init(param, generator)

    def initializers(self) -> Iterator[tuple[nn.Parameter, Callable[[torch.Tensor, torch.Generator | None], None]]]:
        """Each parameter with its init (a function of a tensor of its shape and a generator), in the order
        `reset_parameters` draws them: a tied matrix twice, the head's draw last. Run in this order from one
        generator, they give the same weights whether each writes the parameter or a whole copy of it elsewhere
        (a sharded model keeps its part of each)."""
        std = self.config.init_std
        residual_scale = 1 / math.sqrt(2 * self.config.n_layer) if self.config.scale_residual_init else 1.0

        def normal(std: float) -> Callable[[torch.Tensor, torch.Generator | None], None]:
            return lambda t, g: nn.init.normal_(t, mean=0.0, std=std, generator=g)

        zeros, ones = (lambda t, g: nn.init.zeros_(t)), (lambda t, g: nn.init.ones_(t))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                yield module.weight, normal(std * (residual_scale if name.endswith("c_proj") else 1.0))
                if module.bias is not None:
                    yield module.bias, zeros
            elif isinstance(module, nn.Embedding):  # a tied table gets the same N(0, std) from either side
                yield module.weight, normal(std)
            elif isinstance(module, UnitOffsetRMSNorm):
                yield module.weight, zeros
            elif isinstance(module, TokenShift):  # the plain embedding at first
                yield module.mix, zeros
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.weight is not None:
                yield module.weight, ones
                if getattr(module, "bias", None) is not None:
                    yield module.bias, zeros

    # --- forward -------------------------------------------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        reduction: str = "mean",
        check_ids: bool = True,
        documents: torch.Tensor | None = None,
    ) -> ModelOutput:
        """`ModelOutput(logits, loss)`: logits (B, T, vocab) for every position, and the cross-entropy over targets
        that are not -1 (their mean, or with `reduction="sum"` their sum: a trainer averaging over a whole batch of
        masked targets needs sums), None without targets. Attention weights and every other activation are read
        through the hook points (`gptlab.run_with_cache`).

        With `kv_cache`, idx holds only the new tokens of each row; they are appended to the cache.
        `check_ids=False`: the caller has checked idx and targets against the
        vocabulary already (the trainer does, on the host), so nothing on the forward's path reads a value back.
        `documents` (B, T): which packed document each token belongs to; each attends only within its own, from
        position 0 (`kv_cache.document_masks`).
        """
        if targets is not None and isinstance(idx, torch.Tensor):  # idx itself is checked with the forward
            check_targets_like(idx, targets)
        if check_ids and targets is not None and targets.numel():
            message = (f"a target is outside the vocabulary: targets must be in [0, {self.config.vocab_size}) or -1 "
                       "(ignored)")
            on_device = assert_in_range_on_device(targets, -1, self.config.vocab_size, message)
            if not on_device and targets.device.type == "cpu":
                self.check_targets(targets)
        fusable = targets is not None and self.hooks is None
        tied = tied_gradient(self.transformer.wte, self.lm_head) if fusable else None
        h = self.hidden_states(idx, kv_cache=kv_cache, check_ids=check_ids, documents=documents, tied=tied)
        loss = None
        if targets is None:
            logits = tap(self.hooks, "hook_logits", self.logits(h))
        else:  # the loss's LM head through fp32 where this CPU lacks bf16 matmuls (`linear`); generation's
            # (`logits`) stays the module's own forward, which packed inference weights replace
            head = self.lm_head  # a quantized head (not an nn.Linear) runs its own forward
            fused = (head_cross_entropy(h, head, targets, tied, self.config.logit_softcap) if fusable
                     else None)  # one node on a CPU
            if fused is not None:
                logits, losses = fused
                loss = reduce_losses(losses, targets.flatten(), reduction)
            else:
                raw = upcasting_linear(h, head.weight, head.bias) if isinstance(head, nn.Linear) else head(h)
                logits = tap(self.hooks, "hook_logits", self.softcap_logits(raw))
                loss = cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        return ModelOutput(logits, loss)

    def check_targets(self, targets: torch.Tensor) -> None:
        """A ValueError naming the first target outside the vocabulary (-1, ignored, aside): the loss would
        otherwise fail with a bare IndexError. Two reductions over the targets, nothing next to the forward;
        `forward` runs it on CPU tensors only: on a GPU reading the result back would stall every step, so there
        the check is an assertion on the device (`ops.assert_in_range_on_device`), which names the problem where
        the loss would fail with a bare device-side assert."""
        low, high = int(targets.min()), int(targets.max())
        if low < -1 or high >= self.config.vocab_size:
            bad = low if low < -1 else high
            raise ValueError(f"target {bad} is outside the vocabulary: targets must be in [0, "
                             f"{self.config.vocab_size}) or -1 (ignored)")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head (with the config's soft-capping) over final hidden states (..., C)."""
        return self.softcap_logits(self.lm_head(h))

    def softcap_logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The LM head's output `raw` soft-capped where the config says (Gemma 2: cap * tanh(raw / cap))."""
        cap = self.config.logit_softcap
        return raw if cap is None else cap * torch.tanh(raw / cap)

    def hidden_states(
        self,
        idx: torch.Tensor,
        *,
        kv_cache: KVCache | None = None,
        check_ids: bool = True,
        documents: torch.Tensor | None = None,
        tied: TiedGradient | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states (B, T, C); callers that need only some positions apply `logits` to those.
        `check_ids=False`: idx is known to be in the vocabulary (see `forward`). `tied`: `forward`'s hand-off of a
        tied head's gradient to the token lookup."""
        cfg = self.config
        idx = self._check_input(idx, kv_cache, check_ids)
        B, T = idx.shape
        device = idx.device

        if documents is not None:  # packed documents, each as if alone (no cache: training and scoring)
            if kv_cache is not None or documents.shape != idx.shape:
                raise ValueError(f"documents must have the shape of idx {tuple(idx.shape)} and no kv_cache")
            pos, masks = document_masks(documents, cfg.sliding_window)
        elif kv_cache is None:
            pos = torch.arange(T, device=device)[None]  # (1, T)
            masks = masks_for(pos, T, None, cfg.sliding_window)  # plain causal, unless a window cuts it
        else:
            pos, masks = kv_cache.begin(T, cfg.sliding_window)  # (1 or B, T); which cached keys each query sees

        hooks = self.hooks
        x = self.transformer.wte(idx) if tied is None else tied_embedding(idx, self.transformer.wte.weight, tied)
        if cfg.scale_embeddings:  # by sqrt(C) in the activations' dtype, as Gemma rounds it
            x = x * torch.tensor(math.sqrt(cfg.n_embd), dtype=x.dtype)
        # token shift: where each point finds the previous position's vectors (positions restart in packed documents)
        shifts = Shifts(None if documents is None else pos, kv_cache) if cfg.token_shift else None
        if shifts is not None:
            x = self.transformer.shift(x, shifts.previous(0, x))
        x = tap(hooks, "hook_embed", x)
        if cfg.position == "learned":
            x = x + tap(hooks, "hook_pos_embed", self.transformer.wpe(pos))
        if cfg.embedding_norm:
            x = self.transformer.ln_emb(x)
        x = self.transformer.drop(x)
        rope = rope_tables(cfg, pos) if cfg.position == "rope" else None

        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if recompute:  # keep only each block's input; backward runs its forward again (same dropout masks)
                x = checkpoint(block, x, rope, masks, kv_cache, shifts, use_reentrant=False)
            else:
                x = block(x, rope, masks, kv_cache, shifts)
        x = tap(hooks, "ln_final.hook_normalized", self.transformer.ln_f(x))
        if kv_cache is not None:
            kv_cache.advance(T)
        return x

    def _check_input(self, idx: torch.Tensor, kv_cache: KVCache | None, check_ids: bool = True) -> torch.Tensor:
        """Clear ValueErrors for bad input instead of index errors deep inside torch. The ids' values are read
        back only from CPU tensors: on a GPU that read would stall the host on every forward, so there they are
        an assertion on the device (`ops.assert_in_range_on_device`)."""
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
        if check_ids and not torch.compiler.is_compiling() and not assert_in_range_on_device(
                idx, 0, cfg.vocab_size, f"a token id is outside [0, {cfg.vocab_size}) (the model's vocab_size)"):
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


def parameter_component(name: str) -> str:
    """The component a parameter belongs to, from its name: "embeddings" (token and position tables, and a tied
    head, which is the token table), "head" (an untied LM head), "attention", "mlp", or "norms" (with the other
    vectors outside those: token shift's mixes)."""
    if name.startswith(("transformer.wte", "transformer.wpe")):
        return "embeddings"
    if name.startswith("lm_head"):
        return "head"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "norms"
