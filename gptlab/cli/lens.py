"""`gptlab lens MODEL --prompt TEXT`: the logit lens, the top next-token guesses after each layer, per position."""

from __future__ import annotations

import argparse

from gptlab.cli.attention import add_model_flags, load
from gptlab.errors import GptlabError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lens", help="the logit lens: next-token guesses after each layer",
        description="The logit lens: the residual stream after the embeddings and after each layer, through the "
        "model's final norm and head; per position, each stage's likeliest next tokens. The last layer's are "
        "the model's own.",
    )
    add_model_flags(p)
    p.add_argument("--top-k", type=int, default=3, help="guesses per layer and position (default 3)")
    p.add_argument("--json", metavar="FILE", help="write the guesses as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.fileio import atomic_write_json
    from gptlab.inspection.lens import format_lens, logit_lens

    if args.top_k < 1:
        raise GptlabError(f"--top-k must be at least 1, got {args.top_k}")
    model, tokenizer = load(args)
    result = logit_lens(model, tokenizer, args.prompt, args.top_k)
    if args.json:
        atomic_write_json(args.json, result.to_json(tokenizer))
        print(f"wrote {args.json}")
    else:
        print(format_lens(result, tokenizer))
    return 0
