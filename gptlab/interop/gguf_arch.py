"""Which llama.cpp architecture (`general.architecture`) runs a gptlab model, its hyperparameters and its tensors
under llama.cpp's names.

One mechanism for every family: the Hugging Face family export would pick (`hf.export_family`, which already
refuses switches no family holds) names the llama.cpp architecture its converter writes for that family, and one
table (`ARCHES`) says how that architecture lays out what gptlab keeps uniformly (`attn.c_attn` = [q | k | v],
`mlp.c_fc` = [gate | up]): fused or split, and whether llama.cpp rotates adjacent pairs. What an architecture
cannot read (a sliding window it ignores, RoPE scaling, a score scale it derives itself) is refused in GGUF's own
terms, never written as a different model. GELU runs as llama.cpp's tanh approximation in every architecture, as
its own converter leaves models trained with the exact one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gptlab.checkpoint import plain_shapes
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.hf import _switches_missing, export_family
from gptlab.interop.registry import FAMILIES


@dataclass(frozen=True)
class GgufArch:
    """How one llama.cpp architecture reads a model."""

    name: str  # general.architecture
    fused_qkv: bool = False  # one attn_qkv tensor ([q | k | v] rows), else attn_q, attn_k, attn_v
    fused_gate_up: bool = False  # ffn_up holds [gate | up] (Phi-3), else ffn_gate and ffn_up
    adjacent_rope: bool = False  # RoPE rotates dims (2i, 2i + 1) (llama.cpp's "norm" RoPE), not (i, i + d/2)
    sliding: str = "none"  # which layers the file's attention.sliding_window is for: none, all, alternate (even ones)
    output: bool = True  # reads an output tensor (Gemma 2's head is always the embedding)
    biases: tuple[str, ...] = ()  # bias tensors it requires: a model without them gets zeros, which add nothing
    softcaps: bool = False  # always soft-caps scores and logits (at DEFAULT_SOFTCAPS where the file names no cap)
    default_window: int | None = None  # the window its sliding layers take where the file names none
    unbiased: bool = False  # reads no bias tensor: a model with biases would fail to load (a tensor count off)


# (attention scores, final logits): llama.cpp's caps where a soft-capping architecture's file names none
DEFAULT_SOFTCAPS = (50.0, 30.0)

# llama.cpp's architecture for each Hugging Face family, as its convert_hf_to_gguf.py writes it. GPT-J is the
# exception: llama.cpp names a gptj architecture but does not load it, so GPT-J goes in as phi2, the same block
# (one LayerNorm read by attention and MLP in parallel, partial RoPE, biased MLP and head) with RoPE's pairs
# taken as halves: q and k dims are permuted alike, which leaves every score unchanged.
ARCHES = {
    "GPT2LMHeadModel": GgufArch("gpt2", fused_qkv=True),
    "LlamaForCausalLM": GgufArch("llama", adjacent_rope=True),
    "MistralForCausalLM": GgufArch("llama", adjacent_rope=True),
    "Qwen2ForCausalLM": GgufArch("qwen2"),
    "Qwen3ForCausalLM": GgufArch("qwen3"),
    "Gemma2ForCausalLM": GgufArch("gemma2", sliding="alternate", output=False, softcaps=True, unbiased=True,
                                  default_window=4096),
    "Phi3ForCausalLM": GgufArch("phi3", fused_qkv=True, fused_gate_up=True, sliding="all"),
    "GPTNeoXForCausalLM": GgufArch("gptneox", fused_qkv=True),
    "GPTJForCausalLM": GgufArch("phi2", fused_qkv=True, biases=("attn_qkv", "attn_output")),
}

# a gptlab switch as GGUF says it (what the nearest architecture would need), for refusals
_GGUF_TERMS = {
    "logit_softcap": "final_logit_softcapping", "attn_softcap": "attn_logit_softcapping",
    "qk_norm": "attn_q_norm / attn_k_norm tensors", "qk_norm_weight": "attn_q_norm / attn_k_norm without weights",
    "bias": "bias-free layers (it requires the bias tensors)",
    "norm": "another norm (layer_norm_epsilon vs layer_norm_rms_epsilon)",
    "position": "another position scheme (position_embd vs rope.dimension_count)",
    "mlp": "another feed-forward (ffn_gate and its activation)", "block": "another block layout",
    "sliding_window": "attention.sliding_window", "rope_scaling": "rope.scaling.*",
    "token_shift": "a previous-position mix of the embeddings and MLP inputs (no such tensor)",
}


def gguf_architecture(cfg: GPTConfig) -> GgufArch:
    """llama.cpp's architecture for the config, or a one-line error naming what llama.cpp lacks, in GGUF's terms."""
    try:
        family = export_family(cfg)
    except GptlabError:
        raise GptlabError(_no_architecture(cfg)) from None
    arch = ARCHES[family.ARCHITECTURE]
    if cfg.rope_scaling is not None:
        raise GptlabError(f"GGUF export does not write rope.scaling.* ({cfg.rope_scaling.kind}) yet: "
                          "export to Hugging Face (--to hf) instead")
    if not arch.output and not cfg.tie_embeddings:
        raise GptlabError(f"llama.cpp's {arch.name} has no output tensor (its head is token_embd): "
                          "tie_embeddings=False")
    biased = [f"{name}=True" for name in ("bias", "qkv_bias", "attn_proj_bias", "head_bias") if getattr(cfg, name)]
    if arch.unbiased and biased:
        raise GptlabError(f"llama.cpp's {arch.name} reads no bias tensors: {', '.join(biased)}")
    uncapped = [f"{name}=None" for name in ("attn_softcap", "logit_softcap") if getattr(cfg, name) is None]
    if arch.softcaps and uncapped:
        raise GptlabError(f"llama.cpp's {arch.name} always soft-caps attention scores and logits (at 50 and 30 "
                          f"where attn_logit_softcapping / final_logit_softcapping are missing): {', '.join(uncapped)}")
    window = cfg.sliding_window
    if window is not None and window < cfg.block_size and arch.sliding == "none":
        raise GptlabError(f"llama.cpp's {arch.name} attends to the whole context (it reads no "
                          f"attention.sliding_window): sliding_window={window} is below the context {cfg.block_size}")
    pattern = 2 if arch.sliding == "alternate" else None  # every second layer global, or none
    if window is not None and window < cfg.block_size and cfg.global_layer_every != pattern:
        slides = "even layers only" if arch.sliding == "alternate" else "every layer"
        raise GptlabError(f"llama.cpp's {arch.name} slides {slides} and has no attention.sliding_window_pattern: "
                          f"global_layer_every={cfg.global_layer_every}")
    scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_size ** -0.5
    scalar = score_scalar(arch.name, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_size)
    if abs(scale * scalar ** 0.5 - 1) > 1e-6:
        what = "embedding_length / head_count" if scalar != cfg.head_size else "attention.key_length"
        raise GptlabError(f"llama.cpp's {arch.name} scales attention scores by 1/sqrt({what}) "
                          f"= {scalar ** -0.5:.6g} and reads no other scale: attn_scale={scale:.6g}")
    return arch


def score_scalar(name: str, n_layer: int, n_embd: int, n_head: int, head_size: int) -> int:
    """The d in llama.cpp's 1/sqrt(d) score scale: the head width, but for gemma2 with 46 layers (Gemma 2 27B,
    whose query_pre_attn_scalar is hidden_size / heads), where llama.cpp takes embedding_length / head_count."""
    return n_embd // n_head if name == "gemma2" and n_layer == 46 else head_size


def _no_architecture(cfg: GPTConfig) -> str:
    missing = {family: _switches_missing(family, cfg) for family in FAMILIES}
    nearest = min(FAMILIES, key=lambda family: len(missing[family]))
    terms = [f"{_GGUF_TERMS.get(switch.split('=')[0], switch.split('=')[0])} ({switch})" for switch in missing[nearest]]
    return (f"llama.cpp has no architecture for this model: the nearest, {ARCHES[nearest.ARCHITECTURE].name}, "
            f"lacks {'; '.join(terms)}")


def write_hparams(w: Any, cfg: GPTConfig, arch: GgufArch) -> None:
    """The `{arch}.*` keys llama.cpp reads for the architecture."""
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.hidden_size)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.norm == "layernorm":
        w.add_layer_norm_eps(cfg.norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.norm_eps)
    if cfg.head_size * cfg.n_head != cfg.n_embd:
        w.add_key_length(cfg.head_size)
        w.add_value_length(cfg.head_size)
    if cfg.position == "rope":
        w.add_rope_freq_base(cfg.rope_base)
        w.add_rope_dimension_count(cfg.rotary_dim)
    if arch.name == "gptneox":
        w.add_parallel_residual(cfg.block == "parallel")
    if arch.sliding != "none":  # gemma2 slides at 4096 where the key is missing: no window is the whole context
        w.add_sliding_window(cfg.sliding_window if cfg.sliding_window is not None else cfg.block_size)
    if cfg.attn_softcap is not None:
        w.add_attn_logit_softcapping(cfg.attn_softcap)
    if cfg.logit_softcap is not None:
        w.add_final_logit_softcapping(cfg.logit_softcap)


# gptlab's per-block tensors that keep their shape, under llama.cpp's names
_NORMS = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "ln_attn_out": "post_attention_norm",
          "ln_mlp_out": "post_ffw_norm", "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm"}
_PROJECTIONS = {"attn.c_proj": "attn_output", "mlp.c_proj": "ffn_down"}


def gguf_tensors(cfg: GPTConfig, arch: GgufArch, s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gptlab's tensors under llama.cpp's names, in (out, in) row-major layout (GGUF lists dims reversed)."""
    out = {"token_embd.weight": s["transformer.wte.weight"]}
    if "transformer.wpe.weight" in s:
        out["position_embd.weight"] = s["transformer.wpe.weight"]
    for i in range(cfg.n_layer):
        p, b = f"transformer.h.{i}.", f"blk.{i}."
        for ours, theirs in _NORMS.items():
            out.update(_norm(cfg, s, p + ours, b + theirs))
        for ours, theirs in _PROJECTIONS.items():
            out.update(_renamed(s, p + ours, b + theirs))
        out.update(_attention_in(cfg, arch, s, p + "attn.c_attn", b))
        out.update(_mlp_in(cfg, arch, s, p + "mlp.c_fc", b))
    out.update(_norm(cfg, s, "transformer.ln_f", "output_norm"))
    if arch.output:  # written even when tied (the state dict then holds only the embedding): llama.cpp reads it
        out["output.weight"] = s.get("lm_head.weight", s["transformer.wte.weight"])
        out.update(_renamed(s, "lm_head.bias", "output.bias"))
    for name in [n for n in out if n.endswith(".weight") and n.split(".")[-2] in arch.biases]:
        out.setdefault(name.removesuffix("weight") + "bias", np.zeros(out[name].shape[0], dtype=np.float32))
    return {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in out.items()}


def _renamed(s: dict[str, np.ndarray], ours: str, theirs: str) -> dict[str, np.ndarray]:
    """`ours` (a tensor, or a layer's weight and bias) under `theirs`, for those the state dict has."""
    if ours in s:
        return {theirs: s[ours]}
    return {f"{theirs}.{kind}": s[f"{ours}.{kind}"] for kind in ("weight", "bias") if f"{ours}.{kind}" in s}


def _norm(cfg: GPTConfig, s: dict[str, np.ndarray], ours: str, theirs: str) -> dict[str, np.ndarray]:
    """A norm's tensors; llama.cpp scales by the weight itself, so a (1 + weight) norm (Gemma's) is written + 1."""
    out = _renamed(s, ours, theirs)
    if cfg.norm_unit_offset and f"{theirs}.weight" in out:
        out[f"{theirs}.weight"] = out[f"{theirs}.weight"] + 1
    return out


def _attention_in(cfg: GPTConfig, arch: GgufArch, s: dict[str, np.ndarray], ours: str,
                  b: str) -> dict[str, np.ndarray]:
    """q, k, v (weights and biases) fused or split as the architecture reads them, q and k rows in its RoPE's pairs."""
    q, kv = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size
    out = {}
    for kind in ("weight", "bias"):
        if f"{ours}.{kind}" not in s:
            continue
        w = s[f"{ours}.{kind}"]
        wq, wk, wv = w[:q], w[q:q + kv], w[q + kv:]
        if arch.adjacent_rope != cfg.rope_interleaved:
            wq, wk = rope_rows(wq, cfg, arch.adjacent_rope), rope_rows(wk, cfg, arch.adjacent_rope)
        if arch.fused_qkv:
            out[f"{b}attn_qkv.{kind}"] = np.concatenate([wq, wk, wv])
        else:
            out.update({f"{b}attn_q.{kind}": wq, f"{b}attn_k.{kind}": wk, f"{b}attn_v.{kind}": wv})
    return out


def rope_rows(w: np.ndarray, cfg: GPTConfig, to_adjacent: bool) -> np.ndarray:
    """q or k rows reordered per head between RoPE's two pair layouts: into adjacent pairs (to_adjacent), else into
    halves. Export reorders from gptlab's layout into the architecture's; import the other way."""
    heads = w.shape[0] // cfg.head_size
    rotated = w.reshape(heads, cfg.head_size, -1)[:, :cfg.rotary_dim].reshape(heads * cfg.rotary_dim, -1)
    if to_adjacent:
        rotated = interleave_rope_rows(rotated, heads, cfg.rotary_dim)
    else:
        rotated = halve_rope_rows(rotated, heads, cfg.rotary_dim)
    out = w.reshape(heads, cfg.head_size, -1).copy()
    out[:, :cfg.rotary_dim] = rotated.reshape(heads, cfg.rotary_dim, -1)
    return out.reshape(w.shape)


def _mlp_in(cfg: GPTConfig, arch: GgufArch, s: dict[str, np.ndarray], ours: str, b: str) -> dict[str, np.ndarray]:
    if cfg.mlp not in ("swiglu", "geglu") or arch.fused_gate_up:
        return _renamed(s, ours, b + "ffn_up")
    out = {}
    for kind in ("weight", "bias"):
        if f"{ours}.{kind}" in s:
            gate, up = np.split(s[f"{ours}.{kind}"], 2, axis=0)
            out.update({f"{b}ffn_gate.{kind}": gate, f"{b}ffn_up.{kind}": up})
    return out


def interleave_rope_rows(w: np.ndarray, n_head: int, head_size: int) -> np.ndarray:
    """Per head, rows [0..d/2) and [d/2..d) (rotate-half pairs i, i + d/2) -> rows 0, d/2, 1, d/2 + 1, ...
    (llama.cpp's adjacent pairs), so its RoPE computes what gptlab's does."""
    return w.reshape(n_head, 2, head_size // 2, -1).swapaxes(1, 2).reshape(w.shape)


def halve_rope_rows(w: np.ndarray, n_head: int, rotary_dim: int) -> np.ndarray:
    """The inverse of `interleave_rope_rows`: adjacent pairs (2i, 2i + 1) -> rows 0, 2, 4, ..., 1, 3, 5, ..."""
    return w.reshape(n_head, rotary_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


# --- import: the inverse of gguf_tensors -------------------------------------------------------------------------
def gptlab_tensors(cfg: GPTConfig, arch: GgufArch, take: Callable[..., np.ndarray | None]) -> dict[str, np.ndarray]:
    """A GGUF file's tensors under gptlab's names and layout, the inverse of `gguf_tensors`. `take(name, rows)`
    reads one (None where the file has none), checking its row count when `rows` is given."""
    s = _found(take, "token_embd", "transformer.wte")
    s.update(_found(take, "position_embd", "transformer.wpe"))
    for i in range(cfg.n_layer):
        p, b = f"transformer.h.{i}.", f"blk.{i}."
        for ours, theirs in _NORMS.items():
            s.update(_found(take, b + theirs, p + ours, unit_offset=cfg.norm_unit_offset))
        for ours, theirs in _PROJECTIONS.items():
            s.update(_found(take, b + theirs, p + ours))
        s.update(_attention_from(cfg, arch, take, b, p + "attn.c_attn"))
        s.update(_mlp_from(cfg, arch, take, b, p + "mlp.c_fc"))
    s.update(_found(take, "output_norm", "transformer.ln_f", unit_offset=cfg.norm_unit_offset))
    if not cfg.tie_embeddings:
        s.update(_found(take, "output", "lm_head"))
    elif cfg.head_bias:
        s.update({"lm_head.bias": b} if (b := take("output.bias")) is not None else {})
    return _without_zero_biases(cfg, s)


def _without_zero_biases(cfg: GPTConfig, s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Biases the model has no place for dropped when zero (export fills the ones an architecture requires with
    zeros, which add nothing); a non-zero one would change what the model computes: refused."""
    expected = plain_shapes(cfg)
    for name in [n for n in s if n not in expected and n.endswith(".bias")]:
        if np.any(s.pop(name)):
            raise GptlabError(f"the file holds a non-zero bias for {name}, which a {cfg.hf_architecture} of this "
                              "config has no place for")
    return s


def _found(take: Callable[..., np.ndarray | None], theirs: str, ours: str,
           unit_offset: bool = False) -> dict[str, np.ndarray]:
    """`theirs`' weight and bias, those the file has, under `ours`; a (1 + weight) norm's weight back to its own."""
    out = {}
    for kind in ("weight", "bias"):
        t = take(f"{theirs}.{kind}")
        if t is not None:
            out[f"{ours}.{kind}"] = t - 1 if unit_offset and kind == "weight" else t
    return out


def _attention_from(cfg: GPTConfig, arch: GgufArch, take: Callable[..., np.ndarray | None], b: str,
                    ours: str) -> dict[str, np.ndarray]:
    q, kv = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size
    out = {}
    for kind in ("weight", "bias"):
        if arch.fused_qkv:
            w = take(f"{b}attn_qkv.{kind}", rows=q + 2 * kv)
            if w is None:
                continue
            parts = [w[:q], w[q:q + kv], w[q + kv:]]
        else:
            found = [take(f"{b}attn_{x}.{kind}", rows=n) for x, n in (("q", q), ("k", kv), ("v", kv))]
            if all(t is None for t in found):
                continue
            if any(t is None for t in found):
                raise GptlabError(f"{b}attn_q/k/v.{kind}: the file holds some of the three, not all")
            parts = found
        if arch.adjacent_rope != cfg.rope_interleaved:
            parts[:2] = [rope_rows(t, cfg, cfg.rope_interleaved) for t in parts[:2]]
        out[f"{ours}.{kind}"] = np.concatenate(parts)
    return out


def _mlp_from(cfg: GPTConfig, arch: GgufArch, take: Callable[..., np.ndarray | None], b: str,
              ours: str) -> dict[str, np.ndarray]:
    if cfg.mlp not in ("swiglu", "geglu") or arch.fused_gate_up:
        return _found(take, b + "ffn_up", ours)
    out = {}
    for kind in ("weight", "bias"):
        gate, up = take(f"{b}ffn_gate.{kind}"), take(f"{b}ffn_up.{kind}")
        if gate is not None and up is not None:
            out[f"{ours}.{kind}"] = np.concatenate([gate, up])
        elif gate is not None or up is not None:
            raise GptlabError(f"{b}ffn_gate.{kind} and {b}ffn_up.{kind}: the file holds one without the other")
    return out
