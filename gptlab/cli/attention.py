"""`gptlab attention MODEL --prompt TEXT`: a prompt's attention weights, as heatmaps (-o), JSON (--json) or text.

Pictures: one heatmap for --layer and --head, a grid of the layer's heads for --layer alone, the head in every
layer for --head alone, and each layer's head-average for neither. Without -o or --json the chosen map (default:
the last layer's head-average) is printed as a table.
"""

from __future__ import annotations

import argparse
from typing import Any

from gptlab.cli.options import add_device, check_text
from gptlab.errors import GptlabError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "attention", help="show a prompt's attention weights per layer and head",
        description="Attention weights of a prompt (every family, grouped-query ones included). -o PNG: one map "
        "for --layer and --head, a grid of the layer's heads for --layer alone, the head across layers for --head "
        "alone, each layer's head-average for neither. --json FILE: the weights with the tokens.",
    )
    add_model_flags(p)
    p.add_argument("--layer", type=int, help="layer number, from 0 (default: all layers)")
    p.add_argument("--head", type=int, help="head number, from 0 (default: all heads)")
    p.add_argument("-o", "--output", metavar="PNG", help="write the heatmaps to this PNG (needs gptlab[viz])")
    p.add_argument("--json", metavar="FILE", help="write the weights (per layer and head, with the tokens) as JSON")
    p.set_defaults(run=run)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """MODEL, --prompt and --device: what `attention` and `lens` share."""
    p.add_argument("model", metavar="MODEL",
                   help="a run (its best checkpoint), a checkpoint or a Hugging Face directory")
    p.add_argument("--prompt", required=True, help="the text to look at")
    add_device(p)


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (in eval mode) and its tokenizer, which these commands need to read the prompt."""
    from gptlab.hardware import resolve_device
    from gptlab.loading import load_model

    check_text(args, "--prompt", "--clean", "--corrupt", "--answer", "--wrong")  # before the (slow) load
    model, tokenizer = load_model(args.model, device=resolve_device(args.device))
    if tokenizer is None:
        raise GptlabError(f"{args.model} has no tokenizer: looking at a prompt needs one to turn text into tokens")
    return model.eval(), tokenizer


def format_matrix(weights: Any, tokens: list[str]) -> str:
    """A (T, T) map as text: one row per query token, its weight on each key (blank above the diagonal)."""
    names = [repr(t)[1:-1][:6] for t in tokens]
    width = max(5, *(len(n) for n in names))
    lines = [" " * (width + 2) + " ".join(n.rjust(width) for n in names)]
    for t, row in enumerate(weights.tolist()):
        cells = [f"{w:.2f}".rjust(width) if s <= t else " " * width for s, w in enumerate(row)]
        lines.append(f"{names[t].rjust(width)}  " + " ".join(cells).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from gptlab.fileio import atomic_write_json
    from gptlab.inspection.attention import attention_map, check_index

    for kind in ("layer", "head"):  # negative numbers fail before the load; the upper bound needs the model
        if getattr(args, kind) is not None and getattr(args, kind) < 0:
            raise GptlabError(f"--{kind} must be 0 or more, got {getattr(args, kind)}")
    if args.output:
        from gptlab.inspection.pictures import check_png_path

        check_png_path(args.output)
    model, tokenizer = load(args)
    check_index("layer", args.layer, model.config.n_layer)
    check_index("head", args.head, model.config.n_head)
    amap = attention_map(model, tokenizer, args.prompt)
    if args.json:
        atomic_write_json(args.json, amap.to_json(args.layer, args.head))
        print(f"wrote {args.json}: {amap.n_layer} layers x {amap.n_head} heads over {len(amap.tokens)} tokens")
    if args.output:
        from gptlab.inspection.pictures import attention_picture

        attention_picture(amap, args.output, args.layer, args.head)
        print(f"wrote {args.output}")
    if not args.json and not args.output:
        layer = amap.n_layer - 1 if args.layer is None else args.layer
        which = "mean of the heads" if args.head is None else f"head {args.head}"
        weights = amap.select(layer, args.head)
        print(f"layer {layer}, {which} (row: query, column: key):")
        print(format_matrix(weights.mean(0) if args.head is None else weights, amap.tokens))
    return 0
