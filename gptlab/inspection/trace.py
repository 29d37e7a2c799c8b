"""The forward pass as a table: each step's module, the shapes in and out, its parameters and its FLOPs.

The walkthroughs this project grew from print the shape of every tensor through a block; `trace` does it for any
config. The embeddings, every sub-step of the first block (the q/k/v projection, the head split
(B, T, C) -> (B, nh, T, hs), scores, mask and softmax, the weighted values, the merge, the MLP, the residual adds,
in the order the block's layout runs them), the remaining blocks as one row, the final norm and the head.

Nothing runs: parameters are counted on a model built on the meta device (no memory, so the largest preset answers
in seconds), each counted once (a tied head is the token table); they add up to `parameter_breakdown`'s total.
FLOPs are forward matmul FLOPs by the rule of `gptlab.flops` (2 per weight per token; q k^T and a v at 2 * hs per
key a query sees, T / 2 on average under a causal mask, a window's band on a sliding layer), so they add up to
`flops_per_token(config, T, training=False) * B * T`. Shapes are written with the symbols of `gptlab.model`
(B batch, T sequence, C width, nh / nkv query / key-value heads, hs head size, H MLP width, V vocabulary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn

from gptlab.checkpoint import CONFIG_FILE, LORA_FILE, read_config, read_lora_config
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import read_json_object
from gptlab.flops import keys_per_query
from gptlab.interop.hf import config_from_hf
from gptlab.kv_cache import causal_mask
from gptlab.loading import is_hf_dir, resolve_checkpoint
from gptlab.model import GPT

Shape = tuple[str, ...]
BTC: Shape = ("B", "T", "C")


@dataclass
class TraceRow:
    module: str  # the module's name in the model ("" for a step that is not a module of its own)
    step: str
    shape_in: Shape
    shape_out: Shape
    params: int = 0
    flops: float = 0.0


def config_of(preset_or_model: str) -> GPTConfig:
    """A preset's config, or the config of a run, checkpoint or Hugging Face directory (weights are not read)."""
    if preset_or_model in GPTConfig.presets():
        return GPTConfig.preset(preset_or_model)
    if not Path(preset_or_model).exists():
        raise GptlabError(f"{preset_or_model} is neither a preset ({', '.join(GPTConfig.presets())}) nor a path")
    directory = resolve_checkpoint(preset_or_model)
    if is_hf_dir(directory):
        return config_from_hf(read_json_object(directory / CONFIG_FILE))
    if (directory / LORA_FILE).is_file():  # adapters change no shape: the base's config
        return config_of(read_lora_config(directory)[1]["path"])
    return read_config(directory / CONFIG_FILE)


def sizes(config: GPTConfig, batch: int, seq_len: int) -> dict[str, int]:
    """What each shape symbol stands for."""
    nh, nkv, hs = config.n_head, config.n_kv_head, config.head_size
    H = config.hidden_size
    return {"1": 1, "B": batch, "T": seq_len, "C": config.n_embd, "V": config.vocab_size, "nh": nh, "nkv": nkv,
            "hs": hs, "H": H, "2H": 2 * H, "nh·hs": nh * hs, "(nh+2nkv)·hs": (nh + 2 * nkv) * hs}


def numeric(shape: Shape, dims: dict[str, int]) -> tuple[int, ...]:
    return tuple(dims[d] for d in shape)


class _Counter:
    """Parameters of named modules of a meta-device model, each parameter counted once (tied weights)."""

    def __init__(self, model: GPT) -> None:
        self.modules, self.seen = dict(model.named_modules()), set()

    def __call__(self, *names: str) -> int:
        total = 0
        for name in names:
            for p in self.modules[name].parameters() if name in self.modules else ():
                if id(p) not in self.seen:
                    self.seen.add(id(p))
                    total += p.numel()
        return total


def _linear_flops(count: _Counter, name: str, tokens: int) -> float:
    module = count.modules[name]
    assert isinstance(module, nn.Linear)
    return 2.0 * module.weight.numel() * tokens


def _attention_rows(config: GPTConfig, count: _Counter, p: str, layer: int, tokens: int,
                    seq_len: int) -> list[TraceRow]:
    nh, hs = config.n_head, config.head_size
    per_head = 2.0 * hs * nh * keys_per_query(config, layer, seq_len) * tokens  # q k^T, and a v alike
    window = f" and the window of {config.sliding_window}" if config.sliding_layer(layer) else ""
    rows = [
        TraceRow(f"{p}.attn.c_attn", "q, k, v in one projection", BTC, ("B", "T", "(nh+2nkv)·hs"),
                 count(f"{p}.attn.c_attn"), _linear_flops(count, f"{p}.attn.c_attn", tokens)),
        TraceRow("", "split heads: q; k and v are (B, nkv, T, hs)", ("B", "T", "(nh+2nkv)·hs"), ("B", "nh", "T", "hs")),
    ]
    if config.qk_norm or config.qk_norm_weight:
        norm = f"{p}.attn.q_norm, k_norm" if config.qk_norm_weight else ""  # no module without weights
        rows.append(TraceRow(norm, "RMSNorm of each q and k head", ("B", "nh", "T", "hs"),
                             ("B", "nh", "T", "hs"), count(f"{p}.attn.q_norm", f"{p}.attn.k_norm")))
    if config.position == "rope":
        rows.append(TraceRow("", "RoPE: rotate q and k by position", ("B", "nh", "T", "hs"), ("B", "nh", "T", "hs")))
    groups = f", each k head shared by {nh // config.n_kv_head} q heads" if config.n_kv_head != nh else ""
    rows += [
        TraceRow("", f"scores q k^T x scale{groups}", ("B", "nh", "T", "hs"), ("B", "nh", "T", "T"), 0, per_head),
        TraceRow("", f"causal mask{window}: -inf above the diagonal; softmax",
                 ("B", "nh", "T", "T"), ("B", "nh", "T", "T")),
        TraceRow("", "weights @ v", ("B", "nh", "T", "T"), ("B", "nh", "T", "hs"), 0, per_head),
        TraceRow("", "merge heads", ("B", "nh", "T", "hs"), ("B", "T", "nh·hs")),
        TraceRow(f"{p}.attn.c_proj", "output projection", ("B", "T", "nh·hs"), BTC, count(f"{p}.attn.c_proj"),
                 _linear_flops(count, f"{p}.attn.c_proj", tokens)),
    ]
    if config.attn_softcap is not None:
        rows.insert(-4, TraceRow("", f"soft-cap {config.attn_softcap} x tanh(s / cap)", ("B", "nh", "T", "T"),
                                 ("B", "nh", "T", "T")))
    return rows


def _mlp_rows(config: GPTConfig, count: _Counter, p: str, tokens: int) -> list[TraceRow]:
    gated = config.gated_mlp
    act = {"swiglu": "silu(gate) * up", "geglu": "gelu(gate) * up", "relu2": "relu(h)^2"}.get(config.mlp, "gelu")
    shift = [TraceRow(f"{p}.mlp_shift", "token shift: h + mix * (previous position's h - h)", BTC, BTC,
                      count(f"{p}.mlp_shift"))] if config.token_shift else []
    return [
        *shift,
        TraceRow(f"{p}.mlp.c_fc", "[gate | up] projection" if gated else "up projection", BTC,
                 ("B", "T", "2H" if gated else "H"), count(f"{p}.mlp.c_fc"),
                 _linear_flops(count, f"{p}.mlp.c_fc", tokens)),
        TraceRow("", act, ("B", "T", "2H" if gated else "H"), ("B", "T", "H")),
        TraceRow(f"{p}.mlp.c_proj", "down projection", ("B", "T", "H"), BTC, count(f"{p}.mlp.c_proj"),
                 _linear_flops(count, f"{p}.mlp.c_proj", tokens)),
    ]


def _norm(count: _Counter, name: str, what: str) -> TraceRow:
    return TraceRow(name, what, BTC, BTC, count(name))


def block_rows(config: GPTConfig, count: _Counter, layer: int, tokens: int, seq_len: int) -> list[TraceRow]:
    """One block's sub-steps in the order its layout runs them."""
    p = f"transformer.h.{layer}"
    attn = _attention_rows(config, count, p, layer, tokens, seq_len)
    mlp = _mlp_rows(config, count, p, tokens)
    add = TraceRow("", "residual add: x + attn", BTC, BTC)
    add_mlp = TraceRow("", "residual add: x + mlp", BTC, BTC)
    if config.block == "pre":
        return [_norm(count, f"{p}.ln_1", "norm"), *attn, add, _norm(count, f"{p}.ln_2", "norm"), *mlp, add_mlp]
    if config.block == "parallel":
        ln_2 = [] if config.shared_norm else [_norm(count, f"{p}.ln_2", "norm of x for the MLP")]
        return [_norm(count, f"{p}.ln_1", "norm" + (" (both branches)" if config.shared_norm else "")), *attn,
                *ln_2, *mlp, TraceRow("", "residual add: x + attn + mlp (parallel)", BTC, BTC)]
    if config.block == "sandwich":
        return [_norm(count, f"{p}.ln_1", "norm"), *attn, _norm(count, f"{p}.ln_attn_out", "norm of attn's output"),
                add, _norm(count, f"{p}.ln_2", "norm"), *mlp, _norm(count, f"{p}.ln_mlp_out", "norm of mlp's output"),
                add_mlp]
    return [*attn, add, _norm(count, f"{p}.ln_1", "norm (post)"), *mlp, add_mlp,
            _norm(count, f"{p}.ln_2", "norm (post)")]


def trace(config: GPTConfig, seq_len: int | None = None, batch: int = 1) -> list[TraceRow]:
    """The rows of a forward pass of `batch` sequences of `seq_len` tokens (default: the whole context)."""
    T = config.block_size if seq_len is None else seq_len
    if not 1 <= T <= config.block_size:
        raise GptlabError(f"--seq-len {T} is out of range: this model takes 1..{config.block_size} tokens")
    if batch < 1:
        raise GptlabError(f"--batch must be at least 1, got {batch}")
    with torch.device("meta"):
        model = GPT(config)
    count, tokens = _Counter(model), batch * T
    rows = [TraceRow("transformer.wte", "token embedding lookup", ("B", "T"), BTC, count("transformer.wte"))]
    if config.scale_embeddings:
        rows.append(TraceRow("", "scale by sqrt(C)", BTC, BTC))
    if config.token_shift:
        rows.append(TraceRow("transformer.shift", "token shift: x + mix * (previous token's x - x)", BTC, BTC,
                             count("transformer.shift")))
    if config.position == "learned":
        rows += [TraceRow("transformer.wpe", "position embedding lookup", ("T",), ("1", "T", "C"),
                          count("transformer.wpe")),
                 TraceRow("", "x + positions (broadcast over B)", BTC, BTC)]
    if config.embedding_norm:
        rows.append(_norm(count, "transformer.ln_emb", "norm of the embeddings"))
    rows += block_rows(config, count, 0, tokens, T)
    if config.n_layer > 1:
        rest = [r for layer in range(1, config.n_layer) for r in block_rows(config, count, layer, tokens, T)]
        last = config.n_layer - 1
        name = "transformer.h.1" + (f"..{last}" if last > 1 else "")
        rows.append(TraceRow(name, f"{last} more block{'s' * (last > 1)} like the first", BTC, BTC,
                             sum(r.params for r in rest), sum(r.flops for r in rest)))
    if config.block != "post":
        rows.append(_norm(count, "transformer.ln_f", "final norm"))
    tied = " (tied: the token table)" if config.tie_embeddings else ""
    rows.append(TraceRow("lm_head", f"logits{tied}", BTC, ("B", "T", "V"), count("lm_head"),
                         _linear_flops(count, "lm_head", tokens)))
    if config.logit_softcap is not None:
        rows.append(TraceRow("", f"soft-cap {config.logit_softcap} x tanh(logits / cap)", ("B", "T", "V"),
                             ("B", "T", "V")))
    return rows


def _shape(shape: Shape) -> str:
    return "(" + ", ".join(shape) + ")"


def _count(n: float) -> str:
    if n == 0:
        return "-"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def format_trace(config: GPTConfig, rows: list[TraceRow], batch: int, seq_len: int) -> str:
    """The rows as a text table, the symbols' sizes above it and the totals below."""
    dims = sizes(config, batch, seq_len)
    legend = "  ".join(f"{k}={v}" for k, v in dims.items() if k in ("B", "T", "C", "nh", "nkv", "hs", "H", "V"))
    table = [("module", "step", "in", "out", "params", "FLOPs")]
    table += [(r.module, r.step, _shape(r.shape_in), _shape(r.shape_out), _count(r.params), _count(r.flops))
              for r in rows]
    params, flops = sum(r.params for r in rows), sum(r.flops for r in rows)
    table.append(("total", "", "", "", f"{params:,}", _count(flops)))
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    lines = [f"{config.describe()}", legend, ""]
    for i, row in enumerate(table):
        cells = [c.ljust(w) if j < 4 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(table) - 2:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"forward FLOPs per token: {_count(flops / (batch * seq_len))} (matmuls only; training ~3x)")
    return "\n".join(lines)


def trace_json(config: GPTConfig, rows: list[TraceRow], batch: int, seq_len: int) -> dict:
    """The trace as JSON: sizes, rows (with numeric shapes too) and totals."""
    dims = sizes(config, batch, seq_len)
    out = []
    for r in rows:
        row = asdict(r)
        row["shape_in_numeric"], row["shape_out_numeric"] = numeric(r.shape_in, dims), numeric(r.shape_out, dims)
        out.append(row)
    return {"config": config.to_dict(), "sizes": dims, "rows": out,
            "total": {"params": sum(r.params for r in rows), "flops": sum(r.flops for r in rows)}}


def causal_mask_text(seq_len: int, window: int | None = None) -> str:
    """The model's causal mask (`kv_cache.causal_mask`) for a short T as 0/1 rows: row = query, column = key."""
    mask = causal_mask(torch.arange(seq_len)[None], seq_len, window)[0, 0].int()
    what = f"sliding-window mask (window {window})" if window else "causal mask"
    lines = [f"{what}, T={seq_len}: row t = query t, 1 = may attend to that key"]
    lines += [" ".join(str(v) for v in row) for row in mask.tolist()]
    return "\n".join(lines)
