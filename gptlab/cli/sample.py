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
from typing import TYPE_CHECKING, Any, TextIO

from gptlab.cli.options import (
    add_device,
    add_dtype,
    add_quantize,
    add_speculation,
    check_speculation,
    check_text,
    quantize_options,
    speculation_options,
    torch_dtype,
)
from gptlab.errors import GptlabError
from gptlab.fileio import read_json_object
from gptlab.generation.params import (  # torch-free: `gptlab --help` stays fast
    JSON_OBJECT,
    InvalidSamplingParam,
    SamplingParams,
)
from gptlab.generation.prompts import EmptyPromptError, prompt_char_limit, text_prompt_ids

if TYPE_CHECKING:
    from gptlab.generation.sampling import TokenLogprob
    from gptlab.tokenizer.base import TextTokenizer

SEPARATOR = "\n---------------\n"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample", help="generate text from a run or checkpoint",
        description="Stream continuations of a prompt (echoed first; samples separated by dashes). Defaults as "
        "nanoGPT: prompt \"\\n\", 500 tokens, temperature 0.8, top-k 200. An empty prompt starts from the "
        "end-of-text token. Generation stops at --max-new-tokens or end-of-text.",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="a run (its best checkpoint), a checkpoint or a Hugging Face directory")
    p.add_argument("--prompt", default="\n", help='text to continue (default "\\n"; "" starts from end-of-text)')
    p.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE (overrides --prompt)")
    add_sampling_flags(p)
    p.add_argument("--num-samples", type=int, default=1, help="samples to draw, one after another (default 1)")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="drop the start of a prompt longer than the context instead of failing")
    p.add_argument("--logprobs", type=int, metavar="N",
                   help="after each sample, list on stderr every generated token's log-probability and its N most "
                        "likely alternatives (0: the token's alone)")
    p.add_argument("--steer", metavar="FILE:LAYER:SCALE", action="append", default=[],
                   help="add SCALE x the direction in FILE (safetensors, one vector of the model's width) to the "
                        "residual stream entering block LAYER, at every step; repeatable")
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE",
                            help="the output is JSON valid under the JSON schema in FILE (structured outputs)")
    structured.add_argument("--json", action="store_true", help="the output is a JSON object")
    add_device(p)
    add_dtype(p)  # default auto: bf16 on a GPU; on a CPU float32 (bfloat16 is ~2x faster on recent CPUs)
    add_quantize(p)
    add_speculation(p)
    p.set_defaults(run=run, retain_memory=True)


def add_sampling_flags(
    p: argparse.ArgumentParser, max_new_tokens: int | None = 500,
    max_new_tokens_help: str = "tokens to generate per sample (default 500)",
) -> None:
    """The sampling flags `gptlab sample` and `gptlab chat` share. They are named like SamplingParams' fields,
    which checks their ranges (`sampling_params`)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=max_new_tokens_help)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, help="keep the k most likely tokens; 0 = all (default 200)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the top tokens with probability mass P; 1 = all (default)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens with probability >= MIN_P x the top one's; 0 = all (default)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (HF-style)")
    p.add_argument("--seed", type=int, help="same seed, same samples")
    p.add_argument("--logit-bias", metavar="ID=BIAS", action="append", default=[],
                   help="add BIAS (-100..100) to token ID's logit before sampling; -100 bans it (repeatable)")


def sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    """SamplingParams from the flags (then `overrides`); a value out of range is a one-line error naming its
    flag."""
    try:
        return SamplingParams.from_fields(vars(args), **{"logit_bias": _logit_bias(args.logit_bias), **overrides})
    except InvalidSamplingParam as e:
        raise form_error(e, args) from None


def flag_error(e: InvalidSamplingParam) -> GptlabError:
    """A sampling setting's error named as its flag."""
    return GptlabError(f"--{e.field.replace('_', '-')} {e.requirement}, got {e.value!r}")


def form_error(e: InvalidSamplingParam, args: argparse.Namespace) -> GptlabError:
    """An error of the output's form named as the flag the user gave: the library names its field, json_schema,
    and shows the grammar it compiled, which the user never wrote."""
    json_flag, schema_file = getattr(args, "json", False), getattr(args, "json_schema", None)  # (chat has neither)
    if e.field != "json_schema" or not (json_flag or schema_file):
        return flag_error(e)
    if json_flag and "vocabulary" in e.requirement:  # (JSON_OBJECT itself always compiles)
        return GptlabError("--json: this model's vocabulary cannot spell JSON: no token of it starts or continues a "
                           "JSON object (a character vocabulary made from text without '{', '\"' or '}')")
    flag = "--json" if json_flag else "--json-schema"
    where = "" if json_flag else f" (the schema in {schema_file})"
    return GptlabError(f"{flag} {e.requirement}{where}")


def check_biased_tokens(params: SamplingParams, vocab_size: int) -> None:
    """--logit-bias names tokens of the loaded model's vocabulary (known only once it is loaded)."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise GptlabError(f"--logit-bias names token {bad[0]}, outside the model's vocabulary [0, {vocab_size})")


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS flags as {id: bias}; a malformed one is a one-line error naming it."""
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise GptlabError(f"--logit-bias {pair!r}: expected TOKEN_ID=BIAS, e.g. 50256=-100") from None
    return bias


def _json_schema(args: argparse.Namespace) -> dict[str, Any] | None:
    """The schema the output must satisfy: --json-schema FILE's, --json's any object, or None."""
    if args.json:
        return JSON_OBJECT
    if args.json_schema is None:
        return None
    return read_json_object(args.json_schema, hint="--json-schema takes a file holding a JSON schema")


def _prompt_ids(prompt: str, tokenizer: TextTokenizer, flag: str = "--prompt") -> list[int]:
    """The prompt's token ids, BOS first where the model's tokenizer puts it first; an empty prompt starts from
    BOS there, else from the end-of-text token. `flag` names where the prompt came from in an error."""
    from gptlab.tokenizer import UnknownCharacters

    try:
        ids = tokenizer.encode(prompt) if prompt else []
    except UnknownCharacters as e:  # its own message advises prepare's --tokenizer, which sampling cannot take
        raise GptlabError(e.of(flag)) from None
    try:
        return text_prompt_ids(ids, tokenizer)
    except EmptyPromptError as e:
        raise GptlabError(f"{e}: pass --prompt TEXT") from None


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    path = Path(args.prompt_file)
    if not args.prompt_file or not path.is_file():  # (Path("") is the current directory)
        raise GptlabError(f"--prompt-file {args.prompt_file!r} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GptlabError(f"--prompt-file {path} is not UTF-8 text (bad byte at offset {e.start})") from None


def bound_prompt(prompt: str, block_size: int, truncate: bool) -> str:
    """A prompt no longer than the context can hold, checked on its characters before it is tokenized
    (`gptlab.generation.prompts`). With `truncate` its start is dropped instead; the engine then cuts the tokens
    to the context exactly."""
    limit = prompt_char_limit(block_size)
    if len(prompt) <= limit:
        return prompt
    if truncate:
        return prompt[-limit:]
    raise GptlabError(f"the prompt is {len(prompt):,} characters, more than the model's context of {block_size} "
                      f"tokens can hold: shorten it, or pass --truncate-prompt to keep its end")


def steering_vectors(specs: list[str]) -> list:
    """--steer FILE:LAYER:SCALE values, each file read and checked (its width is checked against the model's
    when it steers)."""
    from gptlab.steering import load_steering

    vectors = []
    for spec in specs:
        parts = spec.rsplit(":", 2)  # a path may hold colons; the last two fields may not
        try:
            path, layer_n, scale_f = parts[0], int(parts[1]), float(parts[2])
        except (ValueError, IndexError):
            raise GptlabError(f"--steer {spec!r}: expected FILE:LAYER:SCALE, e.g. happy.safetensors:6:4.0") from None
        vectors.append(load_steering(path, layer_n, scale_f))
    return vectors


def run(args: argparse.Namespace) -> int:
    from gptlab.generation import Engine, cache_length, stream_deltas
    from gptlab.generation.api import PACK_MIN_TOKENS
    from gptlab.hardware import resolve_device
    from gptlab.loading import load_model

    # every flag is checked before the (slow) model load
    if args.num_samples < 1:
        raise GptlabError(f"--num-samples must be at least 1, got {args.num_samples}")
    params = sampling_params(args, json_schema=_json_schema(args))
    check_text(args, "--prompt")
    prompt = _read_prompt(args)
    steering = steering_vectors(args.steer)
    draft = check_speculation(args)
    device = resolve_device(args.device)
    dtype = torch_dtype(args.dtype, device)
    model, tokenizer = load_model(args.checkpoint, device=device, dtype=dtype, **quantize_options(args))
    speculation = speculation_options(args, draft, device, dtype)
    check_biased_tokens(params, model.config.vocab_size)
    if tokenizer is None:
        raise GptlabError(
            f"{args.checkpoint} has no tokenizer: sampling needs one to turn text into tokens "
            "(save the checkpoint with its tokenizer)"
        )
    prompt = bound_prompt(prompt, model.config.block_size, args.truncate_prompt)
    ids = _prompt_ids(prompt, tokenizer, "--prompt-file" if args.prompt_file is not None else "--prompt")
    # one cache, reused by every sample
    engine = Engine(model, max_batch=1, tokenizer=tokenizer, max_len=cache_length([ids], params.max_new_tokens),
                    pack_weights=params.max_new_tokens * args.num_samples >= PACK_MIN_TOKENS, **speculation)
    out = sys.stdout
    for i in range(args.num_samples):
        try:  # (the schema against the model's vocabulary: known once it is loaded)
            gen = engine.prepare(ids, params, sample_index=i, truncate_prompt=args.truncate_prompt,
                                 steering=steering)
        except InvalidSamplingParam as e:
            raise form_error(e, args) from None
        out.write(prompt)
        out.flush()
        for delta in stream_deltas(engine, gen):
            out.write(delta)
            out.flush()  # stream: the reader sees each piece as soon as it is decoded
        out.write(SEPARATOR)
        out.flush()
        if params.logprobs is not None:
            write_logprobs(gen.logprobs, tokenizer, sys.stderr)
    return 0


def write_logprobs(entries: list[TokenLogprob], tokenizer: TextTokenizer, out: TextIO) -> None:
    """One line per generated token on `out` (stderr: stdout keeps the text alone): the token as text, its
    log-probability, and its alternatives, best first, tab-separated."""
    from gptlab.tokenizer.base import token_text

    def shown(token_id: int) -> str:
        return repr(token_text(tokenizer, token_id))

    out.write("token\tlogprob\talternatives\n")
    for e in entries:
        alternatives = ", ".join(f"{shown(t)} {lp:.4f}" for t, lp in e.top)
        out.write(f"{shown(e.token_id)}\t{e.logprob:.4f}\t{alternatives}\n")
    out.flush()
