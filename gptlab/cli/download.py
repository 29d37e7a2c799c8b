"""`gptlab download`: fetch a model from the Hugging Face Hub, only the files gptlab reads (`gptlab.interop.hub`).

Safetensors weights, configs, tokenizer files and the chat template go to `models/<name>` (or --out DIR); a
repository with only pickle weights is refused. The directory is what every other command takes as MODEL, and
the command says so: it ends by printing where the files went and the next command to run.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download", help="download a model from the Hugging Face Hub (safetensors only)",
        description="Download the safetensors weights, configs, tokenizer files and chat template of a Hugging "
        "Face Hub model (nothing else; a repository with only pickle weights is refused). Large files are checked "
        "against the sha256 the Hub lists. Set HF_TOKEN (or `hf auth login`) for gated or private models.",
    )
    p.add_argument("repo_id", metavar="REPO_ID", help="the model's Hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--out", metavar="DIR", help="where to put the files (default: models/<name>)")
    p.add_argument("--revision", metavar="REV", help="a branch, tag or commit (default: main)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.interop.hub import download_model

    done = download_model(args.repo_id, out=args.out, revision=args.revision)
    print(f"downloaded {done.repo_id} (commit {done.revision[:12]}) to {done.directory}: {len(done.files)} files, "
          f"{_size(done.size)}")
    print(f"next: gptlab chat {done.directory}   (or: gptlab sample {done.directory})")
    return 0


def _size(n: int) -> str:
    value, unit = float(n), "bytes"
    for larger in ("kB", "MB", "GB"):
        if value < 1000:
            break
        value, unit = value / 1000, larger
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
