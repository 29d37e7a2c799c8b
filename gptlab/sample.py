"""`gptlab sample`: stream continuations of a prompt from a run, checkpoint or Hugging Face directory.

The prompt is echoed, then the continuation is printed delta by delta as it is generated (KV-cached), and
samples are separated by a line of dashes. Defaults follow nanoGPT's sample.py: prompt "\\n" (a newline is a
sensible start for character models trained on text), 500 new tokens, temperature 0.8, top-k 200. An empty
prompt starts from the end-of-text token when the tokenizer has one. Temperature 0 is greedy. Generation stops
at max-new-tokens or at the end-of-text token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gptlab.errors import GptlabError

SEPARATOR = "\n---------------\n"


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("max_new_tokens", "temperature", "top_k", "num_samples"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise GptlabError(f"--{name.replace('_', '-')} must not be negative, got {value}")
    if args.num_samples < 1:
        raise GptlabError("--num-samples must be at least 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise GptlabError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise GptlabError(f"--min-p must be in [0, 1], got {args.min_p}")
    if args.repetition_penalty <= 0:
        raise GptlabError(f"--repetition-penalty must be positive, got {args.repetition_penalty}")


def _prompt_ids(args: argparse.Namespace, tokenizer: object) -> tuple[str, list[int]]:
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise GptlabError(f"--prompt-file {path} does not exist")
        prompt = path.read_text(encoding="utf-8")
    else:
        prompt = args.prompt
    if prompt:
        ids = tokenizer.encode(prompt)  # a char vocabulary raises GptlabError naming unknown characters
        if ids:
            return prompt, ids
    eot = getattr(tokenizer, "eot_id", None)
    if eot is None:
        raise GptlabError(
            "the prompt is empty and this tokenizer has no end-of-text token to start from: "
            "pass --prompt TEXT"
        )
    return prompt, [eot]


def run_sample(args: argparse.Namespace) -> int:
    import torch

    from gptlab.checkpoint import load_model
    from gptlab.generate import Engine, SamplingParams, cache_length

    _check_numbers(args)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.checkpoint, device=device, dtype=getattr(torch, args.dtype))
    if tokenizer is None:
        raise GptlabError(
            f"{args.checkpoint} has no tokenizer: sampling needs one to turn text into tokens "
            "(save the checkpoint with its tokenizer)"
        )
    prompt, ids = _prompt_ids(args, tokenizer)
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
        )
    except ValueError as e:
        raise GptlabError(str(e)) from e
    # one cache, reused by every sample
    engine = Engine(model, max_batch=1, tokenizer=tokenizer, max_len=cache_length([ids], args.max_new_tokens))
    out = sys.stdout
    for i in range(args.num_samples):
        gen = engine.prepare(ids, params, sample_index=i, truncate_prompt=args.truncate_prompt)
        out.write(prompt)
        out.flush()
        engine.add([gen])
        while True:
            delta = gen.pop_delta()
            if delta:
                out.write(delta)
                out.flush()  # stream: the reader sees each piece as soon as it is decoded
            if gen.finished:
                break
            engine.step()
        out.write(SEPARATOR)
        out.flush()
    return 0
