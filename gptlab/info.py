"""`gptlab info`: a preset's configuration and parameter counts, computed on the meta device (no memory)."""

from __future__ import annotations

import argparse
import json

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


_BLOCKS = {"pre": "pre-norm", "post": "post-norm", "parallel": "parallel"}


def describe(config: GPTConfig) -> str:
    """One line naming the architecture's switches."""
    kv = "" if config.n_kv_head == config.n_head else f", {config.n_kv_head} kv heads"
    return (f"{config.n_layer} layers, {config.n_head} heads{kv}, width {config.n_embd}, context {config.block_size}, "
            f"vocab {config.vocab_size}; {config.norm}, {config.position} positions, {config.mlp} mlp "
            f"(hidden {config.hidden_size}), {_BLOCKS[config.block]} blocks, "
            f"{'tied' if config.tie_embeddings else 'untied'} head, {'with' if config.bias else 'no'} bias")


def run_info(args: argparse.Namespace) -> int:
    from gptlab.model import parameter_breakdown

    if not args.preset:
        rows = [(name, GPTConfig.preset(name)) for name in GPTConfig.presets()]
        if args.json:
            print(json.dumps({name: parameter_breakdown(c)["total"] for name, c in rows}, indent=2))
            return 0
        for name, config in rows:
            print(f"{name:<18} {_human(parameter_breakdown(config)['total']):>9}  {describe(config)}")
        return 0
    try:
        config = GPTConfig.preset(args.preset)
    except ValueError as e:
        raise GptlabError(str(e)) from None
    counts = parameter_breakdown(config)
    if args.json:
        print(json.dumps({"preset": args.preset, "config": config.to_dict(), "parameters": counts}, indent=2))
        return 0
    print(f"{args.preset}: {describe(config)}")
    width = max(len(f"{v:,}") for v in counts.values())
    for key, value in counts.items():
        share = f"{100 * value / counts['total']:5.1f}%" if key != "total" else ""
        note = " (tied: counted with the embeddings)" if key == "head" and config.tie_embeddings else ""
        print(f"  {key:<11} {value:>{width},} {share}{note}")
    return 0
