"""The `gptlab` command line. Each subcommand's arguments live here; the work lives in its module.

Imports of torch and friends are deferred into the subcommands so that `gptlab --help` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
import sys

from gptlab.errors import GptlabError


def _cmd_info(args: argparse.Namespace) -> int:
    from gptlab.info import run_info

    return run_info(args)


def _cmd_prepare(args: argparse.Namespace) -> int:
    from gptlab.data import run_prepare

    return run_prepare(args)


def _cmd_train(args: argparse.Namespace) -> int:
    from gptlab.train import run_train

    return run_train(args)


def _cmd_sample(args: argparse.Namespace) -> int:
    from gptlab.sample import run_sample

    return run_sample(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from gptlab.evaluate import run_eval

    return run_eval(args)


def _cmd_convert(args: argparse.Namespace) -> int:
    from gptlab.interop import run_convert

    return run_convert(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from gptlab.serve import run_serve

    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptlab", description="Build, train, sample, serve and inspect GPT models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # --- info -------------------------------------------------------------------------------------------------
    p = sub.add_parser("info", help="show a preset's configuration and parameter counts (no memory allocated)")
    p.add_argument("preset", nargs="?", help="preset name; omit to list the presets")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_info)

    # --- prepare ------------------------------------------------------------------------------------------------
    p = sub.add_parser(
        "prepare", help="tokenize text into train.bin / val.bin",
        description="Tokenize text into DATA_DIR/train.bin and val.bin, plus the tokenizer and meta.json. "
        "Inputs are concatenated in order (gpt2/bpe put <|endoftext|> between documents); the last "
        "--val-fraction of the characters becomes the validation split.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text file, directory of .txt files (recursive), or `shakespeare` (downloaded once)")
    tok_group = p.add_mutually_exclusive_group(required=True)
    tok_group.add_argument("--tokenizer", choices=["char", "gpt2", "bpe"],
                           help="char: one id per character; gpt2: tiktoken's GPT-2 BPE; "
                           "bpe: a byte-level BPE trained on the train split")
    tok_group.add_argument("--tokenizer-from", metavar="DIR",
                           help="reuse the tokenizer of a data dir, checkpoint or Hugging Face model dir")
    p.add_argument("--vocab-size", type=int, help="vocabulary size for --tokenizer bpe (at least 257)")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the last fraction of the characters kept for validation (default 0.1)")
    p.add_argument("--workers", type=int, help="tokenizer processes for big inputs (default: min(4, CPUs))")
    p.set_defaults(func=_cmd_prepare)

    # --- train --------------------------------------------------------------------------------------------------
    p = sub.add_parser(
        "train", help="train a model from a TOML recipe",
        description="Train from a TOML recipe (configs/*.toml). Any recipe key can be overridden on the command "
        "line as --key value (dashes or underscores), e.g. --max-steps 500 --lr 3e-3 --dtype bfloat16.",
    )
    p.add_argument("config", metavar="CONFIG.toml", help="the recipe")
    p.add_argument("--data", required=True, metavar="DATA_DIR", help="a directory written by `gptlab prepare`")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="where checkpoints and metrics.jsonl go")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR's latest checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    p.set_defaults(func=_cmd_train, accepts_extra=True)

    # --- sample -------------------------------------------------------------------------------------------------
    p = sub.add_parser(
        "sample", help="generate text from a run or checkpoint",
        description="Stream continuations of a prompt (echoed first; samples separated by dashes). Defaults as "
        "nanoGPT: prompt \"\\n\", 500 tokens, temperature 0.8, top-k 200. An empty prompt starts from the "
        "end-of-text token. Generation stops at --max-new-tokens or end-of-text.",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="a run (its best checkpoint), a checkpoint or a Hugging Face directory")
    p.add_argument("--prompt", default="\n", help='text to continue (default "\\n"; "" starts from end-of-text)')
    p.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE (overrides --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=500, help="tokens to generate per sample (default 500)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, help="keep the k most likely tokens; 0 = all (default 200)")
    p.add_argument("--top-p", type=float, help="nucleus sampling: keep the top tokens with probability mass P")
    p.add_argument("--min-p", type=float, help="keep tokens with probability >= MIN_P x the top one's")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (HF-style)")
    p.add_argument("--seed", type=int, help="same seed, same samples")
    p.add_argument("--num-samples", type=int, default=1, help="samples to draw, one after another (default 1)")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="drop the start of a prompt longer than the context instead of failing")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights' dtype (default float32; bfloat16 is about 2x faster on recent CPUs)")
    p.set_defaults(func=_cmd_sample)

    # --- eval ---------------------------------------------------------------------------------------------------
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
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.set_defaults(func=_cmd_eval)

    # --- convert ------------------------------------------------------------------------------------------------
    p = sub.add_parser(
        "convert", help="convert between gptlab checkpoints and Hugging Face directories",
        description="A Hugging Face directory (GPT2LMHeadModel, LlamaForCausalLM, GPTNeoXForCausalLM) "
        "becomes a gptlab checkpoint; a gptlab checkpoint or run becomes a Hugging Face directory. The "
        "tokenizer comes along when SRC has one. DST is replaced atomically.",
    )
    p.add_argument("src", metavar="SRC", help="a Hugging Face model directory, a gptlab checkpoint or a run")
    p.add_argument("dst", metavar="DST", help="the directory to write")
    p.add_argument("--to", choices=["hf", "gptlab"], help="output format (default: the one SRC is not in)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="cast the weights (default: keep theirs)")
    p.set_defaults(func=_cmd_convert)

    # --- serve --------------------------------------------------------------------------------------------------
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: POST /v1/completions, /v1/chat/completions, GET /v1/models, "
        "/health. Concurrent requests share decoding steps (continuous batching over --max-batch rows).",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT_OR_HF_DIR",
                   help="a run (its best checkpoint), a checkpoint or a Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: env GPTLAB_API_KEY, else none)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="generations allowed to wait for a row; more are answered 429 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per step, between other rows' decoding steps, so a long prompt "
                   "does not stall them (default 256; 0: whole prompts at once)")
    p.add_argument("--model-name", help="the model id clients use (default: the checkpoint directory's name)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights' dtype (default float32; bfloat16 is about 2x faster on recent CPUs)")
    p.set_defaults(func=_cmd_serve)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        if args.func in (_cmd_train, _cmd_eval, _cmd_sample):  # not serve: long-lived, with ever-changing sizes
            from gptlab.hardware import retain_freed_memory

            retain_freed_memory()  # big tensors made and freed every step reuse memory instead of page-faulting
        return int(args.func(args) or 0)
    except GptlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
