"""`gptlab prepare INPUT... --tokenizer {char,gpt2,bpe} --out DATA_DIR`: text files or records -> a data directory."""

from __future__ import annotations

import argparse

from gptlab.errors import GptlabError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare", help="tokenize text or records (jsonl, parquet, chats, ...) into train.bin / val.bin",
        description="Tokenize text into DATA_DIR/train.bin and val.bin, plus the tokenizer and meta.json. "
        "Text inputs are concatenated in order (gpt2/bpe put <|endoftext|> between documents); the last "
        "--val-fraction of the characters becomes the validation split. "
        "Record inputs (.jsonl, .json, .parquet, .csv, .tsv, .arrow, or a directory saved by datasets' "
        "save_to_disk) hold one example per record: {\"text\"}, {\"prompt\", \"completion\"}, {\"messages\": "
        "[{\"role\", \"content\"}]}, ShareGPT {\"conversations\": [{\"from\", \"value\"}]} or preference pairs "
        "{\"prompt\", \"chosen\", \"rejected\"} (for train --objective dpo: each pair two windows, the replies "
        "masked in). Chats are rendered "
        "with the chat template and get a loss mask (train.mask.bin / val.mask.bin: 1 = the assistant's tokens, "
        "the ones trained on); examples are packed into windows of --block-size + 1 tokens; the last "
        "--val-fraction of the records becomes the validation split. Reading parquet and datasets needs "
        "pip install 'gptlab[data]'.",
    )
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="text file, directory of .txt files (recursive), `shakespeare` (downloaded once), or record "
                   "files (.jsonl, .json, .parquet, .csv, .tsv, .arrow, a saved datasets directory); not both kinds")
    tok_group = p.add_mutually_exclusive_group(required=True)
    tok_group.add_argument("--tokenizer", choices=["char", "gpt2", "bpe"],
                           help="char: one id per character; gpt2: tiktoken's GPT-2 BPE; "
                           "bpe: a byte-level BPE trained on the train split")
    tok_group.add_argument("--tokenizer-from", metavar="DIR",
                           help="reuse the tokenizer of a data dir, checkpoint or Hugging Face model dir "
                           "(and its chat template)")
    p.add_argument("--vocab-size", type=int, help="vocabulary size for --tokenizer bpe (at least 257)")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the last fraction of the characters (text) or records kept for validation (default 0.1)")
    p.add_argument("--workers", type=int,
                   help="tokenizer processes for big text inputs (default: min(4, CPUs); records use one)")
    rec = p.add_argument_group("record inputs")
    rec.add_argument("--block-size", type=int, metavar="N",
                     help="the block_size of the model to train; examples are placed in windows of N+1 tokens, "
                     "longer ones cut (and counted). Required for chat, prompt/completion and preference records; "
                     "text records without it are streamed as documents")
    rec.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                     help="pack several examples into each window (default); --no-pack: one example per window, "
                     "padded")
    rec.add_argument("--chat-template", choices=["chatml", "plain"],
                     help="render chats with a built-in template (default: the tokenizer's own, else plain)")
    rec.add_argument("--train-on-prompt", action="store_true",
                     help="train on every token, not only the assistant's (the mask is all 1)")
    rec.add_argument("--text-field", metavar="NAME", help="read plain text documents from field NAME")
    rec.add_argument("--split-name", "--split", metavar="NAME",
                     help="the split of a saved DatasetDict or a streamed dataset to read (default: train)")
    big = p.add_argument_group("large data")
    big.add_argument("--shard-tokens", type=int, metavar="N",
                     help="write each split of text files or streamed documents as shards of N tokens "
                     "(train-000000.bin, ...) with a manifest in meta.json; a killed prepare run again resumes at "
                     "the shard it was writing. Default: shards of 100M tokens for text over 1 GiB and for "
                     "streamed documents, else train.bin / val.bin")
    big.add_argument("--hf-dataset", metavar="OWNER/NAME[/CONFIG]", action="append", default=[],
                     help="stream a Hugging Face dataset's --text-field (default: text), like the INPUT "
                     "hf://datasets/OWNER/NAME[/CONFIG]; record inputs without --block-size are streamed the same "
                     "way: each record a document ended by <|endoftext|>, the --val-fraction of them spread "
                     "through the stream")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import signal

    from gptlab.data import prepare

    # SIGTERM ends Python without running `finally`: make it an exit that does, so the hidden .partial files
    # and the tokenizer worker processes are cleaned up
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    inputs = [*args.inputs, *(f"hf://datasets/{name}" for name in args.hf_dataset)]
    if not inputs:
        raise GptlabError("no input given: pass text or record files, hf://datasets/NAME or --hf-dataset NAME")
    meta = prepare(
        inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        workers=args.workers,
        tokenizer_from=args.tokenizer_from,
        block_size=args.block_size,
        pack=args.pack,
        chat_template=args.chat_template,
        train_on_prompt=args.train_on_prompt,
        text_field=args.text_field,
        split_name=args.split_name,
        shard_tokens=args.shard_tokens,
    )
    if meta.get("shards"):
        n = {s: len(meta["shards"][s]) for s in ("train", "val")}
        print(f"wrote {args.out}: train {meta['train_tokens']:,} tokens in {n['train']} shard(s), val "
              f"{meta['val_tokens']:,} in {n['val']} ({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,})")
        return 0
    about = f"({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']:,}, {meta['dtype']})"
    if not meta.get("mask"):
        print(f"wrote {args.out}: train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens {about}")
        return 0
    w, ex = meta["window_tokens"], meta["examples"]
    n_train, n_val = meta["train_tokens"] // w, meta["val_tokens"] // w
    template = f", {meta['chat_template']} chat template" if meta["chat_template"] else ""
    print(
        f"wrote {args.out}: train {ex['train']:,} examples in {n_train:,} window{'s' * (n_train != 1)} of {w} "
        f"tokens, val {ex['val']:,} in {n_val:,} ({meta['layout']}); {meta['truncated']:,} truncated, "
        f"{meta['dropped']:,} dropped (no target token) {about[:-1]}{template})"
    )
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
