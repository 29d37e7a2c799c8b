"""`gptlab upload SRC REPO_ID`: a run or checkpoint pushed to the Hugging Face Hub in transformers' format, with a
model card."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "upload", help="push a run or checkpoint to the Hugging Face Hub",
        description="Writes SRC as `gptlab convert SRC DST --to hf` does (safetensors, config.json, the tokenizer) "
        "plus a model card (README.md: the model, the run's recipe and its metrics.jsonl), then creates REPO_ID "
        "if needed and uploads the files with huggingface_hub. The token is --token, HF_TOKEN or `hf auth login`'s.",
    )
    p.add_argument("src", metavar="SRC", help="a run directory or a checkpoint")
    p.add_argument("repo_id", metavar="REPO_ID", help="the Hub repository, owner/name")
    p.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded; send nothing")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--token", help="a Hugging Face token (default: HF_TOKEN or the saved login)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.conversion import upload

    done = upload(args.src, args.repo_id, dry_run=args.dry_run, token=args.token, private=args.private)
    if done.url is None:
        print(f"dry run: would upload to {done.repo_id}: {', '.join(done.files)}")
    else:
        print(f"uploaded {', '.join(done.files)} to {done.url}")
    return 0
