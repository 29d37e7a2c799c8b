"""`gptlab plot RUN_DIR [RUN_DIR ...] -o curves.png`: runs' loss curves overlaid, the learning rate beside them."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot", help="plot runs' training curves (needs gptlab[viz])",
        description="Train and val loss of one or more runs (from their metrics.jsonl), overlaid with their "
        "names, the learning rate on a second axis.",
    )
    p.add_argument("runs", metavar="RUN_DIR", nargs="+", help="run directories (`gptlab train --out`)")
    p.add_argument("-o", "--output", metavar="PNG", required=True, help="the picture to write")
    p.add_argument("--x", choices=("step", "tokens", "time"), default="step",
                   help="x axis: optimizer step, tokens seen, or training time in seconds (default step)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.inspection.curves import read_curves
    from gptlab.inspection.pictures import check_png_path, curves_picture

    check_png_path(args.output)
    curves = [read_curves(run, args.x) for run in args.runs]
    curves_picture(curves, args.output, args.x)
    print(f"wrote {args.output}")
    return 0
