"""The lean decode step's blocks as one C++ call (`decode_step` in gptlab/kernels/decode_step.cpp), for a model
whose every Linear runs on gptlab's own kernel: plain Linears inside `PackedLinears.active()`, and int8/int4
`QuantizedLinear`s where that kernel is their forward.

`weights(model)` gathers, per layer, the norms' parameters, each Linear's (packed, qparams, bias) and a token-shift
model's mix in the order the C++ step reads them, with the build whose kernels the Linears were packed for
(`NativeWeights`), or returns None when the step cannot run this model exactly (a Linear on another kernel or
wrapped by an adapter, a norm with an epsilon other than the config's); `step` then runs every block in that build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gptlab.config import GPTConfig
from gptlab.generation.packed_linear import kernel_packed
from gptlab.kernels import kernel_builds
from gptlab.kv_cache import KVCache, Masks
from gptlab.model import GPT
from gptlab.quantize import QuantizedLinear

LAYOUTS = {"pre": 0, "parallel": 1, "sandwich": 2, "post": 3}
MLPS = {"gelu": 0, "swiglu": 1, "geglu": 2, "relu2": 3}
PER_LAYER = 23  # decode_step.cpp's kPerLayer; the final norm's weight and bias follow the layers


def _norm_kind(cfg: GPTConfig) -> int:
    return 2 if cfg.norm_unit_offset else 1 if cfg.norm == "rmsnorm" else 0


def _shape(model: GPT) -> list[int]:
    """decode_step's `shape`: the sizes and switches of decode_step.cpp's Shape, then a sliding flag per layer."""
    cfg, a = model.config, model.transformer.h[0].attn
    qk = 1 if cfg.qk_norm or cfg.qk_norm_weight else 0
    return [a.n_head, a.n_kv_head, a.head_size, cfg.hidden_size, LAYOUTS[cfg.block], int(cfg.shared_norm),
            _norm_kind(cfg), MLPS[cfg.mlp], int(cfg.gelu_approximate == "tanh"), qk, int(cfg.rope_interleaved),
            cfg.rotary_dim if cfg.position == "rope" else 0, *(int(b.attn.sliding) for b in model.transformer.h)]


@dataclass(frozen=True)
class NativeWeights:
    """The C++ step's tensors in its order, and the build (torch.ops namespace) the Linears were packed for: the
    layouts fit every build, but each build's kernels run best on the batch sizes it was chosen for. `front`: what
    the step embeds tokens with (wte, wpe, ln_emb's weight and bias, the embeddings' token-shift mix; None: the
    model's own embedding runs first, e.g. a replaced nn.Embedding); `head`: the LM head's (packed, qparams, bias)
    on the same build (None: the head's own forward)."""

    tensors: list[torch.Tensor | None]
    ops: Any
    shape: list[int]  # decode_step's `shape` (`_shape`), made once with the list
    front: list[torch.Tensor | None] | None = None
    embed_scale: float = 0.0  # Gemma's sqrt(C) in the model's dtype; 0: none
    embed_norm: bool = False
    head: list[torch.Tensor | None] | None = None


def _linear(lin: nn.Module, rows: int) -> tuple[Any, list[torch.Tensor | None]] | None:
    """The build and (packed, qparams, bias) of a Linear that runs on gptlab's kernel right now (a quantized one:
    for inputs of `rows` rows); None otherwise."""
    if isinstance(lin, QuantizedLinear):
        kernel = lin.kernel(rows)
        return None if kernel is None else (kernel[0], [*kernel[1], lin._parameters.get("bias")])
    kernel = kernel_packed(lin)
    return None if kernel is None else (kernel[0], [kernel[1], None, lin._parameters["bias"]])


def _norm(module: nn.Module | None, eps: float) -> list[torch.Tensor | None] | None:
    """(weight, bias) of a norm whose epsilon is `eps` (None, None when absent); None for another epsilon."""
    if module is None:
        return [None, None]
    if getattr(module, "eps", eps) != eps:
        return None
    params = module._parameters
    return [params.get("weight"), params.get("bias")]


def weights(model: GPT, cache: KVCache) -> NativeWeights | None:
    """Every layer's PER_LAYER tensors in decode_step's order and the Linears' build, or None where the C++ step
    cannot run this model now (or this cache: it takes fp32 keys and values, or a bf16 model's in bf16). The engine
    gathers it once and again only when packs change; `_modules` / `_parameters` are read directly, as nn.Module's
    attribute lookup is slow for a walk over every Linear."""
    if not kernel_builds() or cache.k.dtype not in (torch.float32, cache_dtype(model)):
        return None
    if model.transformer.wte.weight.dtype not in (torch.float32, torch.bfloat16):
        return None  # the step computes in bf16 or fp32; an fp16 model's quantized Linears still run on the kernel
    cfg, rows = model.config, cache.batch_size
    eps = cfg.norm_eps
    out: list[torch.Tensor | None] = []
    builds = set()
    for b in model.transformer.h:
        parts = b._modules
        attn, mlp = parts["attn"]._modules, parts["mlp"]._modules
        linears = [_linear(module, rows) for module in (attn["c_attn"], attn["c_proj"], mlp["c_fc"], mlp["c_proj"])]
        norms = [_norm(parts["ln_1"], eps), _norm(parts.get("ln_2"), eps), _norm(parts.get("ln_attn_out"), eps),
                 _norm(parts.get("ln_mlp_out"), eps), _norm(attn.get("q_norm"), eps), _norm(attn.get("k_norm"), eps)]
        if any(g is None for g in linears + norms):
            return None
        builds.update(ops for ops, _ in linears)
        (ln_1, ln_2, attn_out, mlp_out, q_norm, k_norm), (qkv, proj, fc, down) = norms, (t for _, t in linears)
        out += [*ln_1, *qkv, *proj, *ln_2, *fc, *down, *attn_out, *mlp_out]
        out += [q_norm[0], k_norm[0]]  # the q/k norms have a weight only
        out.append(parts["mlp_shift"]._parameters["mix"] if cfg.token_shift else None)  # the MLP input's
    final = model.transformer.ln_f
    final = _norm(None if isinstance(final, nn.Identity) else final, eps)
    if final is None or len(builds) != 1:  # none, or Linears packed for two builds: the per-Linear forwards
        return None
    ops = builds.pop()
    head = _linear(model.lm_head, rows)
    return NativeWeights(out + final, ops, _shape(model), *_front(model),
                         head=head[1] if head is not None and head[0] is ops else None)


def _front(model: GPT) -> tuple[list[torch.Tensor | None] | None, float, bool]:
    """(front, embed_scale, embed_norm) for NativeWeights: the tensors the step embeds tokens with, where the
    embeddings are plain nn.Embedding tables in the model's dtype (else front None: `fast_decode.embed` runs)."""
    cfg, t = model.config, model.transformer
    tables = [t.wte] + ([t.wpe] if cfg.position == "learned" else [])
    dtype = t.wte.weight.dtype
    if any(type(e) is not nn.Embedding or e.weight.dtype != dtype or not e.weight.is_contiguous() for e in tables):
        return None, 0.0, False
    norm = _norm(t.ln_emb, cfg.norm_eps) if cfg.embedding_norm else [None, None]
    if norm is None or dtype not in (torch.float32, torch.bfloat16):
        return None, 0.0, False
    scale = float(torch.tensor(math.sqrt(cfg.n_embd), dtype=dtype)) if cfg.scale_embeddings else 0.0
    mix = t.shift._parameters["mix"] if cfg.token_shift else None
    return [t.wte.weight, tables[1].weight if len(tables) > 1 else None, *norm, mix], scale, cfg.embedding_norm


def cache_dtype(model: GPT) -> torch.dtype:
    """The narrowest cache that holds this model's keys and values exactly, which the C++ step attends over in
    fp32 as it does an fp32 cache: the model's own dtype (bf16: half the bytes attention reads at large batches),
    or fp32."""
    dtype = model.transformer.wte.weight.dtype
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def step(model: GPT, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, masks: Masks,
         cache: KVCache, weights: NativeWeights, head_rows: torch.Tensor | None = None,
         logits: bool = False, greedy_steps: int = 0) -> torch.Tensor:
    """x through every block and the final norm, this token's keys and values written to `cache` (fp32, or bf16
    for a bf16 model): the loop of the lean step in one C++ call. x: the first block's input (B, 1, C), or where
    `weights.front` the tokens (B, 1) the step embeds itself. Returns the hidden states (B, 1, C), or with `logits`
    (and `weights.head`) the LM head's raw output (H, V) of rows `head_rows` (H: all B; the soft-cap is the
    caller's); with `greedy_steps` (rows at one position, the tokens embedded, rope (steps, rot / 2)) the argmax
    tokens (B, steps) of that many steps, each fed the one before's (`fast_decode.decode_greedy`)."""
    cfg, a = model.config, model.transformer.h[0].attn
    where, end = cache.step_target()
    end -= max(greedy_steps - 1, 0)  # (planned for all the greedy steps: the first step's keys)
    rows, pos = (None, None) if isinstance(where, int) else where
    cos = sin = None
    dtype = model.transformer.wte.weight.dtype if weights.front is not None else x.dtype
    if rope is not None:  # (1 or B, 1, 1, rot / 2) fp32, rounded to the model's dtype as apply_rope does
        rot = rope[0].shape[-1]  # (a row per row, or per greedy step)
        cos, sin = (t.reshape(-1, rot) if dtype == torch.float32 else t.to(dtype).float().reshape(-1, rot)
                    for t in rope)
    tokens, x = (x, None) if weights.front is not None else (None, x)
    return weights.ops.decode_step(
        x, weights.tensors, cache.k, cache.v, where if isinstance(where, int) else -1, rows, pos, end, masks.full,
        masks.window, cos, sin, weights.shape, cfg.norm_eps, a.scale, cfg.attn_softcap or 0.0,
        not isinstance(model.transformer.ln_f, nn.Identity), cache.shifted, tokens, weights.front or [],
        weights.embed_scale, weights.embed_norm, weights.head if logits else [], head_rows, cfg.vocab_size,
        greedy_steps)

