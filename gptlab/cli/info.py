"""`gptlab info [PRESET]`: a preset's configuration and parameter counts, computed on the meta device (no memory)."""

from __future__ import annotations

import argparse
import json

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show a preset's configuration and parameter counts (no memory allocated)")
    p.add_argument("preset", nargs="?", help="preset name; omit to list the presets")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def run(args: argparse.Namespace) -> int:
    from gptlab.flops import parameter_breakdown

    if not args.preset:
        rows = [(name, GPTConfig.preset(name)) for name in GPTConfig.presets()]
        if args.json:
            print(json.dumps({name: parameter_breakdown(c)["total"] for name, c in rows}, indent=2))
            return 0
        for name, config in rows:
            print(f"{name:<18} {_human(parameter_breakdown(config)['total']):>9}  {config.describe()}")
        return 0
    try:
        config = GPTConfig.preset(args.preset)
    except ValueError as e:
        raise GptlabError(str(e)) from None
    counts = parameter_breakdown(config)
    if args.json:
        print(json.dumps({"preset": args.preset, "config": config.to_dict(), "parameters": counts}, indent=2))
        return 0
    print(f"{args.preset}: {config.describe()}")
    width = max(len(f"{v:,}") for v in counts.values())
    for key, value in counts.items():
        share = f"{100 * value / counts['total']:5.1f}%" if key != "total" else ""
        note = " (tied: counted with the embeddings)" if key == "head" and config.tie_embeddings else ""
        print(f"  {key:<11} {value:>{width},} {share}{note}")
    return 0
