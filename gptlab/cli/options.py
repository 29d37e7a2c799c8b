"""Flags several commands share, and turning them into the library's types."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError

DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_PREFIX_CACHE_MB = 2**24  # 16 TiB: beyond any machine's memory


def check_text(args: argparse.Namespace, *flags: str) -> None:
    """Each of `flags` given as text holds only UTF-8: Python reads an argument's other bytes as lone surrogates,
    which no tokenizer reads (a Hugging Face one raises a TypeError); flags the command lacks are skipped."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        bad = next((i for i, c in enumerate(value) if "\ud800" <= c <= "\udfff"), None) if isinstance(value, str) \
            else None
        if bad is not None:
            code = ord(value[bad])
            what = f"byte 0x{code - 0xDC00:02x}" if code >= 0xDC80 else f"a lone surrogate U+{code:04X}"
            raise GptlabError(f"{flag} is not UTF-8 text: {what} at character {bad}")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:1, mps, ... (default: cuda when available, else mps on a Mac, else cpu)")


def add_dtype(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=help or "weights' dtype (default auto: bfloat16 "
                   "on a GPU with bf16 units, float16 on an older GPU, float32 on a CPU; bfloat16 there is about 2x "
                   "faster on recent CPUs)")


def torch_dtype(name: str, device: str) -> Any:
    """The torch dtype named by a --dtype flag (one of DTYPES: argparse has checked it) for a model on `device`."""
    from gptlab.hardware import inference_dtype

    return inference_dtype(name, device)


def add_quantize(p: argparse.ArgumentParser) -> None:
    """--quantize and --group-size: weight-only int8 / int4 Linear layers for inference (`gptlab.quantize`)."""
    p.add_argument("--quantize", choices=("int8", "int4"), help="quantize the Linear weights (blocks and LM head): "
                   "int8 per output channel, or int4 in groups of --group-size inputs")
    p.add_argument("--group-size", type=int, metavar="N", help="with --quantize int4: inputs per scale and zero "
                   "point, 32, 64, 128 or 256 (default 32)")


def quantize_options(args: argparse.Namespace) -> dict[str, Any]:
    """`load_model`'s quantize and group_size from the flags (it checks them before loading anything)."""
    return {"quantize": args.quantize, "group_size": args.group_size}


def add_prefix_cache(p: argparse.ArgumentParser) -> None:
    """--prefix-cache-mb: the budget of `gptlab.generation.prefix_cache` (its default, 512 MB, when not given)."""
    p.add_argument("--prefix-cache-mb", type=float, metavar="MB",
                   help="memory for the keys and values of prompts' beginnings (a system prompt, the conversation so "
                   "far), kept so that later prompts starting alike prefill only the rest; least recently used "
                   "dropped first (default 512; 0: off)")


def prefix_cache_options(args: argparse.Namespace) -> dict[str, float]:
    """The library's prefix_cache_mb from the flag (nothing when not given: the library's default), checked."""
    mb = args.prefix_cache_mb
    if mb is None:
        return {}
    if not 0 <= mb <= MAX_PREFIX_CACHE_MB:  # (also refuses nan)
        raise GptlabError(f"--prefix-cache-mb must be 0 (off) or a size in MB up to {MAX_PREFIX_CACHE_MB}, got {mb}")
    return {"prefix_cache_mb": mb}


def add_speculation(p: argparse.ArgumentParser) -> None:
    """--draft / --speculate ngram and --draft-tokens: speculative decoding (`gptlab.generation.speculative`)."""
    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument("--draft", metavar="MODEL", help="speculative decoding with this smaller model (a run, "
                         "checkpoint or Hugging Face directory sharing the model's tokenizer) guessing tokens that "
                         "the model checks several at a time; same outputs, faster when most guesses are right")
    drafter.add_argument("--speculate", choices=("ngram",), help="speculative decoding with prompt lookup: guesses "
                         "are what followed the last few tokens' latest earlier occurrence (text that repeats its "
                         "input, e.g. edits)")
    p.add_argument("--draft-tokens", type=int, metavar="K",
                   help="with --draft or --speculate: tokens guessed per check (default 4)")
    p.add_argument("--draft-quantize", choices=("int8", "int4", "none"),
                   help="with --draft: quantize the draft's Linear weights (default: as --quantize does the model's; "
                        "none: keep them in the model's dtype). The draft reads all its weights for every guess: "
                        "int8 makes guessing cheaper, and the model checks every guess all the same")


def check_speculation(args: argparse.Namespace) -> Path | None:
    """The speculation flags checked before the model loads, so that a bad one costs no model load first: --draft
    resolved to its checkpoint from the files alone (no weights read); None without --draft."""
    if args.draft_tokens is not None and args.draft_tokens < 1:
        raise GptlabError(f"--draft-tokens must be at least 1, got {args.draft_tokens}")
    if args.draft_tokens is not None and not (args.draft or args.speculate):  # else it would be ignored
        raise GptlabError("--draft-tokens needs --draft or --speculate (the drafter whose guesses it counts)")
    if args.draft_quantize and not args.draft:
        raise GptlabError("--draft-quantize needs --draft (the draft model it quantizes)")
    if not args.draft:
        return None
    from gptlab.loading import resolve_checkpoint

    try:
        return resolve_checkpoint(args.draft)
    except GptlabError as e:
        raise GptlabError(f"--draft: {e}") from None


def speculation_options(args: argparse.Namespace, draft: Path | None, device: Any, dtype: Any) -> dict[str, Any]:
    """The engine's `speculate` and `draft_tokens` from the flags (checked by `check_speculation`, which gave
    `draft`): the draft model loaded (on the model's device, in its dtype, quantized as --draft-quantize, by default
    as the model), or "ngram"; nothing without either flag."""
    tokens = {} if args.draft_tokens is None else {"draft_tokens": args.draft_tokens}
    if args.speculate:
        return {"speculate": args.speculate, **tokens}
    if draft is None:
        return {}
    from gptlab.loading import load_model

    quantize = args.quantize if args.draft_quantize is None else args.draft_quantize
    # --group-size belongs to --quantize int4: an int8 draft takes none
    group = {"group_size": args.group_size} if quantize == "int4" else {}
    quantized = {"quantize": quantize, **group} if quantize not in (None, "none") else {}
    try:
        model, _ = load_model(draft, device=device, dtype=dtype, **quantized)
    except GptlabError as e:  # the model itself loaded: what failed is the draft's
        raise GptlabError(f"--draft: {e}") from None
    return {"speculate": model, **tokens}
