"""`gptlab patch MODEL --clean TEXT --corrupt TEXT`: activation patching between two prompts of the same length,
as a heat map (-o), JSON (--json) or a table.

Each cell is the logit difference (answer - wrong, at the last position) of the corrupted prompt with one site's
activation taken from the clean prompt: a layer and position of the residual stream (or an attention / MLP
output), or a layer and head (`--point z`: each head's output over all positions). The answer and the wrong
token default to each prompt's likeliest next token.
"""

from __future__ import annotations

import argparse

from gptlab.cli.attention import load
from gptlab.cli.options import add_device

POINTS = "resid_pre|resid_mid|resid_post|attn_out|mlp_out|z"  # checked by patch_prompts (PATCH_POINTS)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "patch", help="activation patching between a clean and a corrupted prompt",
        description="Patch each layer's activation at each position (or each head's output, --point z) from the "
        "clean prompt into the corrupted one and report the logit difference answer - wrong at the last "
        "position. -o PNG: a heat map; --json FILE: the values with the tokens.",
    )
    p.add_argument("model", metavar="MODEL",
                   help="a run (its best checkpoint), a checkpoint or a Hugging Face directory")
    p.add_argument("--clean", required=True, help="the prompt whose activations are patched in")
    p.add_argument("--corrupt", required=True, help="the prompt they are patched into (as many tokens)")
    p.add_argument("--answer", help="the token the clean prompt should predict (default: its likeliest)")
    p.add_argument("--wrong", help="the token the corrupted prompt predicts (default: its likeliest)")
    p.add_argument("--point", metavar=POINTS, default="resid_pre",
                   help="what to patch: the residual stream entering (resid_pre, default), halfway through "
                        "(resid_mid) or leaving (resid_post) each block, the attention or MLP output, or each "
                        "head's output (z)")
    p.add_argument("-o", "--output", metavar="PNG", help="write the heat map to this PNG (needs gptlab[viz])")
    p.add_argument("--json", metavar="FILE", help="write the values (per layer and position or head) as JSON")
    add_device(p)
    p.set_defaults(run=run)


def format_map(values: list[list[float]], columns: list[str]) -> str:
    names = [repr(c)[1:-1][:7] for c in columns]
    width = max(7, *(len(n) for n in names))
    lines = ["layer  " + " ".join(n.rjust(width) for n in names)]
    lines += [f"{i:>5}  " + " ".join(f"{v:.3f}".rjust(width) for v in row) for i, row in enumerate(values)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from gptlab.fileio import atomic_write_json
    from gptlab.inspection.patching import patch_prompts

    if args.output:
        from gptlab.inspection.pictures import check_png_path

        check_png_path(args.output)
    model, tokenizer = load(args)
    pmap = patch_prompts(model, tokenizer, args.clean, args.corrupt, args.point, args.answer, args.wrong)
    print(f"logit {pmap.answer!r} - logit {pmap.wrong!r}: clean {pmap.clean:.3f}, corrupted {pmap.corrupt:.3f}")
    if args.json:
        atomic_write_json(args.json, pmap.to_json())
        print(f"wrote {args.json}")
    if args.output:
        from gptlab.inspection.pictures import patching_picture

        patching_picture(pmap, args.output)
        print(f"wrote {args.output}")
    if not args.json and not args.output:
        columns = [f"head {h}" for h in range(pmap.values.shape[1])] if pmap.point == "attn.hook_z" else pmap.tokens
        print(f"{args.point} patched from the clean prompt (row: layer, column: "
              f"{'head' if pmap.point == 'attn.hook_z' else 'position'}):")
        print(format_map(pmap.values.tolist(), columns))
    return 0
