"""The `gptlab` command line: the only place that sees argparse. One module per command, each with
`register(subparsers)` (its flags) and `run(args)` (turn the flags into typed calls of the library).

Command modules import torch and friends inside `run`, so `gptlab --help` and argument errors stay fast.

Errors end in one line on stderr, never a traceback: a `GptlabError` (bad input, a damaged file, an unkind
machine) exits 2; an unexpected exception (a bug) prints "error: internal error: ..." and exits 1, or re-raises
with its traceback when GPTLAB_DEBUG=1; a reader that closed the pipe (`gptlab sample ... | head`) ends it
quietly with 141, as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import os
import sys

from gptlab.cli import (
    attention,
    chat,
    convert,
    download,
    evaluate,
    info,
    lens,
    patch,
    plot,
    prepare,
    sample,
    serve,
    trace,
    train,
    upload,
)
from gptlab.cli.collector import freeze_at_exit, import_torch_quietly
from gptlab.errors import GptlabError

COMMANDS = (info, download, prepare, train, sample, chat, evaluate, convert, upload, serve, trace, attention, lens,
            patch, plot)


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
        retain = getattr(args, "retain_memory", False)  # True, or serve's bound (long-lived, sizes that vary)
        if retain:
            if retain is True:
                import_torch_quietly()  # commands that need torch: less start-up (and shutdown: freeze_at_exit)
                freeze_at_exit()
            from gptlab.hardware import retain_freed_memory

            # big tensors made and freed every step reuse memory instead of page-faulting
            retain_freed_memory(None if retain is True else retain)
        return int(args.run(args) or 0)
    except (GptlabError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"error: {one_line(e, limit=None)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gptlab sample ... | head`: the reader left; stop quietly, as `yes | head` does
        _silence_stdout()
        return 141
    except MemoryError as e:
        print(f"error: out of memory ({one_line(e) or 'allocation failed'}): try a smaller batch, model or "
              "input", file=sys.stderr)
        return 2
    except OSError as e:  # the machine said no: a full disk, an unreadable file
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or one_line(e)}{where}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: one line, unless asked for the traceback to report it
        if os.environ.get("GPTLAB_DEBUG") == "1":
            raise
        print(f"error: internal error: {type(e).__name__}: {one_line(e)} (set GPTLAB_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


def one_line(e: BaseException, limit: int | None = 400) -> str:
    """An exception's message on one line (library messages from torch or numpy span many), cut at `limit`."""
    text = " ".join(str(e).split())
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
