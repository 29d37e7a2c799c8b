"""`gptlab trace PRESET_OR_MODEL`: the forward pass as a table of shapes, parameters and FLOPs (meta device)."""

from __future__ import annotations

import argparse
import json

from gptlab.errors import GptlabError

MAX_MASK = 16  # --mask prints at most this many rows and columns


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="the forward pass as a table: shapes, parameters and FLOPs per step",
        description="The forward pass module by module: embeddings, every sub-step of one block (the head split "
        "(B, T, C) -> (B, nh, T, hs), scores, mask, softmax, ...), the head; shapes in and out, parameters and "
        "forward FLOPs. Computed on the meta device: no weights are read or allocated.",
    )
    p.add_argument("model", metavar="PRESET_OR_MODEL",
                   help="a preset name (`gptlab info` lists them), a run, a checkpoint or a Hugging Face directory")
    p.add_argument("--seq-len", type=int, help="T, tokens per sequence (default: the model's context)")
    p.add_argument("--batch", type=int, default=1, help="B, sequences (default 1)")
    p.add_argument("--mask", action="store_true", help=f"also print the causal mask (T up to {MAX_MASK})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.inspection.trace import causal_mask_text, config_of, format_trace, trace, trace_json

    if args.seq_len is not None and args.seq_len < 1:
        raise GptlabError(f"--seq-len must be at least 1, got {args.seq_len}")
    config = config_of(args.model)
    T = args.seq_len or config.block_size
    rows = trace(config, T, args.batch)
    if args.json:
        print(json.dumps(trace_json(config, rows, args.batch, T), indent=1))
        return 0
    print(format_trace(config, rows, args.batch, T))
    if args.mask:
        short = min(T, MAX_MASK)
        print()
        print(causal_mask_text(short))
        if config.sliding_window is not None and config.sliding_window < short:
            print()
            print(causal_mask_text(short, config.sliding_window))
    return 0
