"""`gptlab eval RUN_OR_CHECKPOINT --data DATA_DIR [--split val] [--json]`: loss, perplexity, bits per byte."""

from __future__ import annotations

import argparse
import json

from gptlab.cli.options import add_device, add_dtype, torch_dtype


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="score a model on a validation split",
        description="Loss, perplexity and bits per byte over a whole split: non-overlapping windows of block_size, "
        "every target token scored once.",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run (its best checkpoint), a checkpoint or "
                   "a Hugging Face directory")
    p.add_argument("--data", required=True, metavar="DATA_DIR", help="a directory written by `gptlab prepare`")
    p.add_argument("--split", default="val", choices=["train", "val"])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--block-size", type=int, help="window length (default: the model's block_size)")
    p.add_argument("--batch-size", type=int, help="windows per forward pass (default: ~4k tokens on CPU, ~64k on GPU)")
    add_dtype(p)
    add_device(p)
    p.set_defaults(run=run, retain_memory=True)



def run(args: argparse.Namespace) -> int:
    from gptlab.data import read_meta
    from gptlab.evaluate import evaluate_split
    from gptlab.hardware import resolve_device
    from gptlab.loading import load_model

    read_meta(args.data)  # a bad data directory fails before the model is loaded
    device = resolve_device(args.device)
    model, _ = load_model(args.checkpoint, device=device)
    out = evaluate_split(model, args.data, args.split, block_size=args.block_size, batch_size=args.batch_size,
                         dtype=torch_dtype(args.dtype), device=device)
    if args.json:
        print(json.dumps(out))
        return 0
    bpb = out["bits_per_byte"]
    bpb_text = f"{bpb:.4f}" if bpb is not None else "n/a (no tokenizer in the data directory)"
    print(f"{args.split} loss {out[f'{args.split}_loss']:.4f}  perplexity {out['perplexity']:.3f}  bits/byte "
          f"{bpb_text}  ({out['tokens']:,} tokens, block_size {out['block_size']})")
    return 0
