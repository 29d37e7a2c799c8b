"""`gptlab eval RUN_OR_CHECKPOINT [--data DATA_DIR] [--split val] [--json]`: loss, perplexity, bits per byte (of a
run's own data directory without --data).
`gptlab eval RUN_OR_CHECKPOINT --tasks T1,T2 [--include-path DIR] [--limit N] [--num-fewshot N] [--json]`: lm-eval
tasks (`gptlab.evaluation.harness`), one line per task and metric."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from gptlab.cli.options import add_device, add_dtype, add_quantize, quantize_options, torch_dtype
from gptlab.errors import GptlabError

if TYPE_CHECKING:
    from gptlab.tokenizer import Tokenizer

NO_LM_EVAL = "lm-eval is not installed: pip install 'gptlab[eval]'"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="score a model on a validation split or on lm-eval tasks",
        description="With --data (by default the data a gptlab run trained on): loss, perplexity and bits per "
        "byte over a whole split (non-overlapping windows of "
        "block_size, every target token scored once). With --tasks: lm-evaluation-harness tasks, scored as "
        "lm-eval's hf backend scores them.",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run (its best checkpoint), a checkpoint or "
                   "a Hugging Face directory")
    p.add_argument("--data", metavar="DATA_DIR", help="a directory written by `gptlab prepare` (default, without "
                   "--tasks: the one a gptlab run trained on)")
    p.add_argument("--tasks", metavar="T1,T2", help="lm-eval task (or group) names, comma-separated (needs "
                   "gptlab[eval])")
    p.add_argument("--split", choices=["train", "val"], help="with --data (default val)")
    p.add_argument("--include-path", metavar="DIR", help="with --tasks: a directory of task YAML files")
    p.add_argument("--limit", type=float, metavar="N", help="with --tasks: the first N examples of each task "
                   "(a fraction when below 1)")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="with --tasks: few-shot examples per prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--block-size", type=int, help="window length (default: the model's block_size)")
    p.add_argument("--batch-size", type=int, help="windows per forward pass (default: ~4k tokens on CPU, ~64k on "
                   "GPU); requests per batch with --tasks (default 8)")
    add_dtype(p)
    add_quantize(p)
    add_device(p)
    p.set_defaults(run=run, retain_memory=True)


def run(args: argparse.Namespace) -> int:
    if args.data is not None and args.tasks is not None:
        raise GptlabError("give one of --data DATA_DIR (a prepared split) or --tasks T1,T2 (lm-eval tasks), not both")
    _check_mode_flags(args)
    if args.data is None and args.tasks is None:
        args.data = _run_data(args.checkpoint)
    for flag, value in (("--block-size", args.block_size), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise GptlabError(f"{flag} must be at least 1, got {value}")
    if args.tasks is not None:
        return _run_tasks(args)
    args.split = args.split or "val"
    from gptlab.data import read_meta
    from gptlab.evaluation.loss import check_batch_memory, evaluate_split
    from gptlab.hardware import resolve_device
    from gptlab.loading import load_model

    read_meta(args.data)  # a bad data directory fails before the model is loaded
    device = resolve_device(args.device)
    model, tokenizer = load_model(args.checkpoint, device=device, **quantize_options(args))
    _check_same_tokenizer(args.checkpoint, tokenizer, args.data)
    # (past the context, the model's own error named the split's length, not the flag)
    if args.block_size is not None and args.block_size > model.config.block_size:
        raise GptlabError(f"--block-size {args.block_size} is more than the model's context of "
                          f"{model.config.block_size} tokens")
    if args.batch_size is not None:
        check_batch_memory(model.config, args.batch_size, args.block_size or model.config.block_size, device,
                           "--batch-size")
    out = evaluate_split(model, args.data, args.split, block_size=args.block_size, batch_size=args.batch_size,
                         dtype=torch_dtype(args.dtype, device), device=device,
                         document_eot=_trained_document_eot(args.checkpoint, read_meta(args.data)))
    if args.json:  # JSON has no infinity: an overflowed perplexity is null
        print(json.dumps({**out, "perplexity": out["perplexity"] if math.isfinite(out["perplexity"]) else None}))
        return 0
    bpb = out["bits_per_byte"]
    bpb_text = f"{bpb:.4f}" if bpb is not None else "n/a (no tokenizer in the data directory)"
    masked = ", documents scored alone as the run trained them" if out["document_mask"] else ""
    print(f"{args.split} loss {out[f'{args.split}_loss']:.4f}  perplexity {out['perplexity']:.3f}  bits/byte "
          f"{bpb_text}  ({out['tokens']:,} tokens, block_size {out['block_size']}{masked})")
    return 0


def _check_mode_flags(args: argparse.Namespace) -> None:
    """Refuse a flag of the other mode (a split's loss, or lm-eval tasks), which would change nothing, and task
    limits lm-eval would misread."""
    if args.tasks is None:
        for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                            ("--include-path", args.include_path)):
            if value is not None:
                raise GptlabError(f"{flag} needs --tasks T1,T2 (it shapes lm-eval tasks, not a split's loss)")
        return
    if args.split is not None:
        raise GptlabError("--split picks a prepared split (--data), not a split of --tasks: lm-eval tasks score "
                          "their own")
    # (written so that nan and inf fail too)
    if args.limit is not None and not (0 < args.limit < 1 or args.limit >= 1 and args.limit.is_integer()):
        raise GptlabError(f"--limit must be a number of examples (a whole number, 1 or more) or a fraction in (0, 1), "
                          f"got {args.limit:g}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise GptlabError(f"--num-fewshot must be 0 or more, got {args.num_fewshot}")


def _trained_document_eot(checkpoint: str, meta: dict[str, Any]) -> int | None:
    """The end-of-text id that ends the data's documents, where the run trained with `document_mask` (each packed
    document attending only within itself): scored the same way, as its own evaluations were; else None."""
    from gptlab.checkpoint import recorded_setting
    from gptlab.data import document_end_id

    recipe = recorded_setting(checkpoint, "train")
    if not isinstance(recipe, dict) or recipe.get("document_mask") is not True:
        return None
    return document_end_id(meta)


def _check_same_tokenizer(checkpoint: str, model_tok: Tokenizer | None, data: str) -> None:
    """Refuse data whose ids mean other text than the model's (char data for a GPT-2 model): its vocabulary fits,
    so it would score, as nonsense. Either tokenizer unknown (a model saved without one): nothing to compare."""
    from gptlab.tokenizer import fingerprint, optional_tokenizer

    data_tok = optional_tokenizer(data)[0]
    if model_tok is None or data_tok is None or fingerprint(model_tok) == fingerprint(data_tok):
        return
    raise GptlabError(f"--data {data} was tokenized with another tokenizer ({data_tok.kind}, {data_tok.vocab_size} "
                      f"ids) than {checkpoint} ({model_tok.kind}, {model_tok.vocab_size} ids): prepare the data with "
                      f"--tokenizer-from {checkpoint}")


def _run_data(checkpoint: str) -> str:
    """Without --data or --tasks: the data directory the run trained on, where it records one that still exists."""
    from gptlab.checkpoint import recorded_data_dir

    ask = "give --data DATA_DIR (a prepared split) or --tasks T1,T2 (lm-eval tasks)"
    try:
        data = recorded_data_dir(checkpoint)
    except GptlabError as e:
        raise GptlabError(f"{e}; {ask}") from None
    if data is None:
        raise GptlabError(f"{ask}: {checkpoint} is not a gptlab run that records its data directory")
    if not data.is_dir():
        raise GptlabError(f"{ask}: the data directory {checkpoint} trained on, {data}, is not there any more")
    print(f"note: scoring {data}, the data the run trained on (--data DATA_DIR for another)", file=sys.stderr)
    return str(data)


def _run_tasks(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise GptlabError(NO_LM_EVAL)
    from gptlab.evaluation.harness import run_tasks
    from gptlab.hardware import resolve_device

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    out = run_tasks(args.checkpoint, tasks, include_path=args.include_path, limit=limit,
                    num_fewshot=args.num_fewshot, batch_size=args.batch_size or 8, device=args.device,
                    dtype=torch_dtype(args.dtype, resolve_device(args.device)), max_length=args.block_size,
                    **quantize_options(args))
    results = out.get("results", {})
    if args.json:
        print(json.dumps(results, default=str))
        return 0
    rows = [("task", "metric", "value", "stderr")] + _table_rows(results)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _table_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """One row per task and metric: lm-eval keys its metrics "name,filter", with "name_stderr,filter" beside."""
    rows = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            name, comma, filt = key.partition(",")
            if not comma or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue  # alias, sample_len, ...
            stderr = metrics.get(f"{name}_stderr,{filt}")
            label = name if filt == "none" else f"{name} ({filt})"
            rows.append((task, label, _number(value), _number(stderr) if isinstance(stderr, (int, float)) else ""))
    return rows


def _number(x: float) -> str:
    return f"{x:.4f}" if abs(x) < 1e6 else f"{x:.4g}"  # perplexities of bad models run into the billions
