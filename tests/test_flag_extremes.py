"""Every value-taking flag of every command at its extremes (not-a-number, negative, overflowing, empty): either
the command runs, or it answers in one line and exits 2. Never an internal error (GPTLAB_DEBUG=1 turns one into a
failing exception here), a traceback or a hang.

The rows run in-process (`gptlab.cli.main`) against one tiny trained run, under a SIGALRM bound per row, as in
`test_bad_inputs`. Flags that name files or carry free text are left to the damaged-file and bad-input tables.
"""

from __future__ import annotations

import argparse
import io
import os
import sys

import pytest
from helpers import cli_outcome, make_data, write_recipe

from gptlab.cli import build_parser, main

ROW_SECONDS = 60  # a bound per row, not a performance target: only a hang comes near it
VALUES = ("nan", "-1", "1e999", "99999999999999999999", "")
NOT_SWEPT = {"--out", "-o", "--json", "--tokenizer-from", "--init-from", "--text", "--prompt", "--chat-template",
             "--system", "--model-name", "--api-key", "--prompt-file"}  # paths and free text: other tables
LONG_BY_DESIGN = {("sample", "--num-samples", "99999999999999999999")}  # streams samples until interrupted


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("flag_extremes")
    os.environ.setdefault("GPTLAB_CACHE_DIR", str(root / "cache"))
    data = make_data(root, chars=20_000)
    recipe = write_recipe(root, max_steps=2, checkpoint_interval=2, eval_interval=2, log_interval=2,
                          eval_tokens=256, warmup_steps=1)
    run = root / "run"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet"]) == 0
    text = root / "text.txt"
    text.write_text("hello world " * 50)
    r = str(run)
    return {
        "sample": ["sample", r, "--max-new-tokens", "4"],
        "chat": ["chat", r],
        "eval": ["eval", r],
        "attention": ["attention", r, "--text", "hello", "-o", str(root / "a.png")],
        "lens": ["lens", r, "--text", "hello"],
        "trace": ["trace", r, "--text", "hello"],
        "prepare": ["prepare", str(text), "--tokenizer", "char", "--out", str(root / "prepared")],
        "convert": ["convert", r, str(root / "converted")],
        "plot": ["plot", r, "-o", str(root / "p.png")],
        "serve": ["serve", r, "--port", "0"],  # not 8000: another program may hold it
    }


def value_flags(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return [a.option_strings[-1] for a in sub._actions
            if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)
            and a.option_strings[-1] not in NOT_SWEPT]


def outcome(argv: list[str]) -> tuple[int, list[str]]:
    """(exit code, stderr's error lines) of one in-process command line, bounded in time."""
    rc, lines = cli_outcome(argv, ROW_SECONDS)
    return rc, [line for line in lines if "error" in line]


@pytest.mark.parametrize("command", ["sample", "chat", "eval", "attention", "lens", "trace", "prepare", "convert",
                                     "plot", "serve"])
def test_every_flag_at_its_extremes_runs_or_answers_in_one_line(
    command: str, world: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gptlab.cli.serve as serve_cli

    monkeypatch.setenv("GPTLAB_NO_KERNELS", "1")  # which kernel runs is not what a flag's check is about
    monkeypatch.setenv("GPTLAB_DEBUG", "1")  # an internal error raises here instead of printing one line
    monkeypatch.setattr(serve_cli, "serve_on_main_thread", lambda *a: None)  # `serve` checks all, then would listen
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # `chat` reads turns until end of input
    flags = value_flags(command)
    assert flags, f"{command} has no value-taking flag to sweep"
    for flag in flags:
        for value in VALUES:
            if (command, flag, value) in LONG_BY_DESIGN:
                continue
            rc, errors = outcome([*world[command], flag, value])
            row = f"gptlab {command} {flag} {value!r}"
            assert rc in (0, 2), f"{row}: exit {rc}, {errors}"
            assert len(errors) <= 1, f"{row}: {errors}"
            assert (rc == 2) == bool(errors), f"{row}: exit {rc} with {errors}"
