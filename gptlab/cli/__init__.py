"""The `gptlab` command line: the only place that sees argparse. One module per command, each with
`register(subparsers)` (its flags) and `run(args)` (turn the flags into typed calls of the library).

Command modules import torch and friends inside `run`, so `gptlab --help` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
import sys

from gptlab.cli import chat, convert, download, evaluate, info, prepare, sample, serve, train
from gptlab.errors import GptlabError

COMMANDS = (info, download, prepare, train, sample, chat, evaluate, convert, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptlab", description="Build, train, sample, serve and inspect GPT models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        if getattr(args, "retain_memory", False):  # not serve: long-lived, with ever-changing sizes
            from gptlab.hardware import retain_freed_memory

            retain_freed_memory()  # big tensors made and freed every step reuse memory instead of page-faulting
        return int(args.run(args) or 0)
    except (GptlabError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
