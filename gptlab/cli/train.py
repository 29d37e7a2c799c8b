"""`gptlab train CONFIG.toml --data DATA_DIR --out RUN_DIR [--resume] [--key value ...]`.

Any recipe key can be overridden on the command line. argparse cannot know those keys (they are the fields of
TrainConfig and GPTConfig), so it leaves them over (`args.extra`); `parse_overrides` turns that token list into
key -> text, and the library parses each text by its field's type.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import TYPE_CHECKING

from gptlab.errors import GptlabError

if TYPE_CHECKING:
    from gptlab.train import TrainConfig
    from gptlab.train.benchmarks import LmEvalScorer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model from a TOML recipe",
        description="Train from a TOML recipe (configs/*.toml). Any recipe key can be overridden on the command "
        "line as --key value (dashes or underscores), e.g. --max-steps 500 --lr 3e-3 --dtype bfloat16.",
    )
    p.add_argument("config", metavar="CONFIG.toml", help="the recipe")
    p.add_argument("--data", metavar="DATA_DIR",
                   help="a directory written by `gptlab prepare`, or a mixture A:0.7,B:0.3 (each row of a step "
                   "drawn from a source by weight; validation on the first); default: the recipe's [data] table")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="where checkpoints and metrics.jsonl go")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR's latest checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    p.set_defaults(run=run, retain_memory=True, accepts_extra=True)


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """`--key value` / `--key=value` pairs (dashes or underscores in the key) as key -> raw text."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        arg = tokens[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise GptlabError(f"unexpected argument {arg!r}: overrides are written --key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens) or (tokens[i + 1].startswith("--") and len(tokens[i + 1]) > 2):
                raise GptlabError(f"--{key} needs a value")
            value = tokens[i + 1]
            i += 1
        out[key.replace("-", "_")] = value
        i += 1
    return out


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run: the same flags and overrides, plus --resume; under torchrun, launched
    by torchrun again on as many processes (its variables say how many, on how many machines)."""
    argv = [args.config, *(["--data", args.data] if args.data is not None else []), "--out", args.out]
    argv = shlex.join(argv + (["--quiet"] if args.quiet else []) + list(args.extra) + ["--resume"])
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return f"gptlab train {argv}"
    if os.environ.get("GROUP_WORLD_SIZE") == "1" and "LOCAL_WORLD_SIZE" in os.environ:  # one machine
        launch = shlex.join(["torchrun", "--standalone", "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"]])
    else:  # each machine's rendezvous options are its own
        launch = "torchrun [this run's torchrun options, on every machine]"
    return f"{launch} -m gptlab.cli train {argv}"


def _lm_eval_tasks(cfg: TrainConfig) -> LmEvalScorer | None:
    """The scorer of the recipe's lm-eval eval_tasks (their names checked now), or None when it has none."""
    import importlib.util

    from gptlab.train.benchmarks import lm_eval_task_names

    names = lm_eval_task_names(cfg)
    if not names:
        return None
    if importlib.util.find_spec("lm_eval") is None:
        raise GptlabError(f"eval_tasks {', '.join(names)} are lm-eval tasks and lm-eval is not installed: pip "
                          "install 'gptlab[eval]' (or give multiple-choice .jsonl files)")
    from gptlab.evaluation.harness import LmEvalTasks

    try:
        return LmEvalTasks(names, limit=cfg.eval_tasks_limit)
    except GptlabError as e:
        raise GptlabError(f"eval_tasks: {e}") from None


def run(args: argparse.Namespace) -> int:
    from gptlab.data.dataset import parse_sources, recipe_sources
    from gptlab.fileio import check_out_dir
    from gptlab.train import Trainer, load_train_config

    cfg = load_train_config(args.config, parse_overrides(args.extra))
    out = check_out_dir(args.out)  # before the data: `--out ""` must not mean the current directory
    sources = parse_sources(args.data) if args.data is not None else recipe_sources(args.config)
    if sources is None:
        raise GptlabError(f"no data to train on: pass --data DATA_DIR, or give {args.config} a [data] table "
                          "(\"DIR\" = weight lines)")
    for data_dir, _ in sources:
        if not data_dir.is_dir():
            raise GptlabError(f"data directory {data_dir} does not exist; run `gptlab prepare ... --out {data_dir}` "
                              "first")
    trainer = Trainer(cfg, sources[0][0], out, resume=args.resume, quiet=args.quiet,
                      resume_command=resume_command(args), mixture=sources if len(sources) > 1 else None,
                      lm_eval_tasks=_lm_eval_tasks(cfg))
    return trainer.run()
