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
    p = sub.add_parser("train", help="train a model from a TOML recipe")
    p.set_defaults(func=_cmd_train)

    # --- sample -------------------------------------------------------------------------------------------------
    p = sub.add_parser("sample", help="generate text from a run or checkpoint")
    p.set_defaults(func=_cmd_sample)

    # --- eval ---------------------------------------------------------------------------------------------------
    p = sub.add_parser("eval", help="score a model on a validation split")
    p.set_defaults(func=_cmd_eval)

    # --- convert ------------------------------------------------------------------------------------------------
    p = sub.add_parser("convert", help="convert between gptlab checkpoints and Hugging Face directories")
    p.set_defaults(func=_cmd_convert)

    # --- serve --------------------------------------------------------------------------------------------------
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.set_defaults(func=_cmd_serve)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
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
