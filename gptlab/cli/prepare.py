"""`gptlab prepare INPUT... --tokenizer {char,gpt2,bpe} --out DATA_DIR`: text files -> a data directory."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.data import prepare

    meta = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        workers=args.workers,
        tokenizer_from=args.tokenizer_from,
    )
    print(
        f"wrote {args.out}: train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens "
        f"({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,}, {meta['dtype']})"
    )
    return 0
