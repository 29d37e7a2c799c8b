"""Multiple-choice tasks scored by log-likelihood, offline: a CORE-like bundle of small benchmarks from local
files, cheap enough to score during training.

A task is a JSON Lines file, one example a line: {"context": "...", "choices": ["...", ...], "answer": i}. Each
choice is scored as lm-eval scores a multiple-choice request: the sum of the log-probabilities of the choice's
tokens after the context, the pair split as lm-eval splits it (trailing whitespace of the context goes to the
continuation; the continuation's tokens are those the joined text holds past the context's; a tokenizer that puts
BOS first, as Llama's does, gets it before the context; an empty context is BOS, else end-of-text). Per task:

    acc          the share of examples whose highest-scoring choice is the answer
    acc_norm     the same with each score divided by the choice's length in characters (lm-eval's acc_norm)
    centered     acc rescaled so that chance (1 / the number of choices, averaged over examples) is 0 and
                 perfect is 1, as DCLM's CORE score centers each task

and over the tasks, `core`: the mean of their centered accuracies.

`continuation_scores` is the one scoring routine: the lm-eval adapter (`gptlab.evaluation.harness`) scores its
requests with it too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from gptlab.errors import GptlabError
from gptlab.fileio import read_utf8

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


@torch.inference_mode()
def continuation_scores(model: Any, pairs: Sequence[Pair], max_length: int) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per pair, in one
    right-padded forward; position t's logits score token t + 1, so the input is context + continuation less
    its last token, cut on the left to `max_length`."""
    device = next(model.parameters()).device
    for _, cont in pairs:
        if not cont or len(cont) > max_length:
            raise GptlabError(f"a continuation of {len(cont)} tokens: it needs 1 to max_length ({max_length})")
    rows = [(ctx + cont)[-(max_length + 1):][:-1] for ctx, cont in pairs]
    idx = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        idx[i, : len(row)] = torch.tensor(row)
    hidden = model.hidden_states(idx.to(device))
    out = []
    for i, ((_, cont), row) in enumerate(zip(pairs, rows, strict=True)):
        logprobs = F.log_softmax(model.logits(hidden[i, len(row) - len(cont) : len(row)]).float(), dim=-1)
        target = torch.tensor(cont, device=device)
        score = logprobs.gather(-1, target[:, None]).sum()
        out.append((float(score), bool((logprobs.argmax(-1) == target).all())))
    return out


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class ChoiceTask:
    name: str  # the file's stem
    examples: tuple[Example, ...]


def _example(row: Any, where: str) -> Example:
    if not isinstance(row, dict):
        raise GptlabError(f"{where}: expected an object with context, choices and answer")
    context, choices, answer = row.get("context"), row.get("choices"), row.get("answer")
    if not isinstance(context, str):
        raise GptlabError(f"{where}: context must be a string")
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
        raise GptlabError(f"{where}: choices must be a list of at least 2 non-empty strings")
    if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
        raise GptlabError(f"{where}: answer must be the index of the right choice (0 to {len(choices) - 1})")
    return Example(context, tuple(choices), answer)


def load_choice_task(path: str | Path) -> ChoiceTask:
    """A task from its .jsonl file; a one-line error naming the file and line for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise GptlabError(f"eval task {path} not found (a .jsonl file of context / choices / answer lines)")
    examples = []
    for n, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise GptlabError(f"{path}:{n} is not JSON") from None
        examples.append(_example(row, f"{path}:{n}"))
    if not examples:
        raise GptlabError(f"eval task {path} has no examples")
    return ChoiceTask(path.stem, tuple(examples))


def start_token(tokenizer: TextTokenizer) -> int | None:
    """The token an empty context becomes: BOS, else end-of-text (lm-eval's prefix token); None with neither."""
    return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eot_id


def split_pair(tokenizer: TextTokenizer, context: str, continuation: str, prefix_token: int | None) -> Pair:
    """Context and continuation tokens as lm-eval's `TemplateLM` splits them: the context's trailing whitespace
    moves to the continuation, BOS starts the context where the tokenizer adds it (as transformers encodes), and
    an empty context becomes `prefix_token`."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        if prefix_token is None:
            raise GptlabError("an example with an empty context needs a start token (BOS or end-of-text), which this "
                              "tokenizer lacks")
        return [prefix_token], tokenizer.encode(continuation)
    bos = [tokenizer.bos_id] if tokenizer.adds_bos and tokenizer.bos_id is not None else []
    whole, ctx = bos + tokenizer.encode(context + continuation), bos + tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def score_choice_task(model: Any, tokenizer: TextTokenizer, task: ChoiceTask, *, limit: int | None = None,
                      batch_size: int = 16) -> dict[str, float]:
    """{acc, acc_norm, centered} of `task` (its first `limit` examples) on `model` (in eval mode)."""
    examples = task.examples[:limit]
    start = start_token(tokenizer)
    pairs = [split_pair(tokenizer, ex.context, choice, start) for ex in examples for choice in ex.choices]
    max_length = model.config.block_size
    scores = []
    for i in range(0, len(pairs), batch_size):
        scores += [s for s, _ in continuation_scores(model, pairs[i : i + batch_size], max_length)]
    right = right_norm = chance = 0.0
    for ex in examples:
        mine, scores = scores[: len(ex.choices)], scores[len(ex.choices):]
        right += max(range(len(mine)), key=lambda j: mine[j]) == ex.answer
        right_norm += max(range(len(mine)), key=lambda j: mine[j] / len(ex.choices[j])) == ex.answer
        chance += 1 / len(ex.choices)
    n = len(examples)
    acc, chance = right / n, chance / n
    return {"acc": acc, "acc_norm": right_norm / n, "centered": (acc - chance) / (1 - chance)}


def score_choice_tasks(model: Any, tokenizer: TextTokenizer, tasks: Sequence[ChoiceTask], *, limit: int | None = None,
                       batch_size: int = 16) -> dict[str, float]:
    """Every task's scores as "<task>/<metric>", and "core": the mean of their centered accuracies."""
    out: dict[str, float] = {}
    for task in tasks:
        scores = score_choice_task(model, tokenizer, task, limit=limit, batch_size=batch_size)
        out.update({f"{task.name}/{k}": v for k, v in scores.items()})
    if tasks:
        out["core"] = sum(out[f"{t.name}/centered"] for t in tasks) / len(tasks)
    return out
