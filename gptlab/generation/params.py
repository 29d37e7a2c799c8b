"""`SamplingParams`: how one request is decoded, checked once, in one place.

Every caller (the Python API, `gptlab sample`, `gptlab serve`) builds its settings through this class, so each
range is checked here and nowhere else: a number's range beside its field (`gptlab.checked`), the lists' rules in
`_check`. A bad value raises `InvalidSamplingParam`, which names the field: the
command line turns it into an error about `--top-p`, the server into a 400 whose `param` is `top_p`.

Every integer setting is bounded (seed: int64; top_k, max_new_tokens: [0, INT64_MAX]) because torch holds them
as int64: an unbounded one would pass here and fail later, in the middle of a batch shared with others. Stop
strings are bounded in number and length (MAX_STOPS, MAX_STOP_CHARS): the text decoder scans each one per token.

Every control has one "off" value that means the same everywhere: top_k 0, top_p 1.0, min_p 0.0 (None is
accepted for each and stored as that value), penalties 1.0 / 0.0, logprobs None.

This module imports no torch, so the server's request schemas and the command line can use it without paying
for torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gptlab.checked import InvalidField, bounded, check_fields
from gptlab.fileio import parse_json

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch's integers (seeds, top-k) are int64
MAX_STOPS = 64  # stop strings per request (the server allows fewer: its policy, in serve/schemas.py)
MAX_STOP_CHARS = 512  # characters per stop string
MAX_LOGIT_BIAS = 1024  # biased tokens per request
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, +100 all but forces it
MAX_SCHEMA_CHARS = 100_000  # a JSON schema's text (its grammar is compiled per request)
# levels of JSON nesting in a schema: llguidance's reader stops at 128 and a chat template's tojson recurses per level
MAX_SCHEMA_DEPTH = 64
JSON_OBJECT = {"type": "object"}  # OpenAI's json_object mode: any JSON object


class InvalidSamplingParam(InvalidField):
    """A sampling setting out of its range; `field` is the SamplingParams field, `requirement` what it must be."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bias_pairs(bias: Any) -> tuple:
    """logit_bias as sorted (id, bias) pairs: from a mapping or pairs; an id given twice is refused, a shape that
    is neither is kept as it is for `_check` to refuse."""
    try:
        pairs = list(bias.items()) if isinstance(bias, Mapping) else [tuple(p) for p in bias]
    except TypeError:
        return (bias,)
    if any(len(p) != 2 for p in pairs):
        return tuple(pairs)
    ids = [_as_int(t) for t, _ in pairs]
    pairs = [(t if i is None else i, b) for i, (t, b) in zip(ids, pairs, strict=True)]
    named = [i for i in ids if i is not None]  # (an id that is no integer is `_check`'s to name)
    if len(set(named)) < len(named):
        raise InvalidSamplingParam("logit_bias", bias, "must name each token once")
    try:
        return tuple(sorted(pairs, key=lambda p: p[0]))
    except TypeError:  # ids that do not compare: `_check` names them
        return tuple(pairs)


def _as_int(value: Any) -> int | None:
    """An integer-like value (e.g. a 0-d tensor or numpy integer) as an int; None when it is not one."""
    try:
        return int(value) if int(value) == value else None
    except (TypeError, ValueError):
        return None


def _schema_text(schema: Any) -> Any:
    """A JSON schema as its JSON text (a frozen, comparable value); a value that is neither a mapping nor text is
    kept for `_check_schema` to refuse."""
    if isinstance(schema, Mapping):
        if (problem := schema_depth_problem(schema)) is not None:  # before json.dumps recurses through it
            raise InvalidSamplingParam("json_schema", "{...}", f"must be a JSON schema that {problem}")
        try:
            return json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidSamplingParam("json_schema", schema, f"must be JSON ({e})") from None
    return schema


def json_grammar(schema: str) -> str:
    """llguidance's grammar for a JSON schema (text). Whitespace between tokens is fixed (", ", ": "), not free:
    a grammar that allows any whitespace lets a model wander in it until max_tokens."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def schema_start(schema: Any) -> Any:
    """A schema as errors show it: its first 60 characters (a whole schema is no one-line message)."""
    return schema if not isinstance(schema, str) or len(schema) <= 60 else schema[:57] + "..."


def json_depth(value: Any) -> int:
    """How deeply `value` (parsed JSON) nests lists and objects (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def schema_depth_problem(schema: Any) -> str | None:
    """Why a schema (parsed JSON) nests too deeply, or None: one bound for SamplingParams and the server's tools."""
    depth = json_depth(schema)
    return f"nests {depth} levels deep, at most {MAX_SCHEMA_DEPTH}" if depth > MAX_SCHEMA_DEPTH else None


def _check_schema(schema: Any) -> None:
    """A JSON schema that the grammar library compiles (checked without a tokenizer: the vocabulary's part is
    `generation.grammar`'s)."""
    if schema is None:
        return
    shown = schema_start(schema)
    if not isinstance(schema, str) or len(schema) > MAX_SCHEMA_CHARS:
        raise InvalidSamplingParam("json_schema", shown, f"must be a JSON schema of at most {MAX_SCHEMA_CHARS} "
                                   "characters")
    try:
        parsed = parse_json(schema)
        if not isinstance(parsed, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise InvalidSamplingParam("json_schema", shown, f"must be a JSON schema, a JSON object ({e})") from None
    if (problem := schema_depth_problem(parsed)) is not None:
        raise InvalidSamplingParam("json_schema", shown, f"must be a JSON schema that {problem}")
    _check_compiles("json_schema", shown, lambda: json_grammar(schema), "a schema")


def checked_json_schema(schema: Mapping[str, Any] | str) -> dict[str, Any]:
    """`schema` (a mapping or its JSON text) checked as SamplingParams checks json_schema, parsed: for a grammar
    that holds it beside other alternatives (a tool-calling reply's content); InvalidSamplingParam naming
    json_schema otherwise."""
    text = _schema_text(schema)
    _check_schema(text)
    return json.loads(text)


def _check_compiles(name: str, shown: Any, grammar: Any, what: str) -> None:
    """That llguidance compiles `grammar()` (a grammar's text), else InvalidSamplingParam naming field `name`."""
    try:
        from llguidance import LLMatcher  # the `structured` extra; imports no torch
    except ImportError:
        raise InvalidSamplingParam(name, shown, "needs the llguidance package: "
                                   "pip install 'gptlab[structured]'") from None
    try:
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar())
    except ValueError as e:  # the schema's reader refused it before any grammar was made
        failed, messages = True, [str(e)]
    if failed:
        first = " ".join(messages[0].split())  # llguidance points at the place over several lines: one line here
        raise InvalidSamplingParam(name, shown, f"is not {what} gptlab can enforce: {first}")


def _check_grammar(grammar: Any) -> None:
    """A llguidance grammar that compiles (its vocabulary's part is `generation.grammar`'s, as a schema's)."""
    if grammar is None:
        return
    shown = schema_start(grammar)
    if not isinstance(grammar, str) or len(grammar) > MAX_SCHEMA_CHARS:
        raise InvalidSamplingParam("grammar", shown, f"must be a grammar of at most {MAX_SCHEMA_CHARS} characters")
    _check_compiles("grammar", shown, lambda: grammar, "a grammar")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Filters apply in this order: penalties, temperature, top-k, top-p, min-p.

    - temperature: logits / T before sampling; 0 = greedy (argmax of the penalized logits).
    - top_k: keep the k most likely tokens (ties with the k-th are kept too). 0 = off.
    - top_p: keep the smallest set of most likely tokens whose probabilities sum to >= top_p (nucleus). 1 = off.
    - min_p: keep tokens whose probability is >= min_p * (the top token's probability). 0 = off.
    - repetition_penalty (Hugging Face / CTRL): for every token that occurs in the prompt or the output so
      far, a positive logit is divided by it and a negative one multiplied by it. 1 = off; > 1 discourages
      repeats.
    - frequency_penalty / presence_penalty (OpenAI): logit[j] -= count[j] * frequency + (count[j] > 0) *
      presence, where count[j] is how often token j was generated so far (the prompt is not counted). 0 = off.
    - seed: the row's own torch.Generator is seeded with it (sample i of a request with seed + i mixed in), so
      the same seed gives the same text whatever else is in the batch. None = drawn from torch's global RNG.
    - stop: strings that end the row; the text up to (not including) the first one is returned.
    - stop_token_ids: token ids that end the row (the tokenizer's end-of-text is added unless ignore_eot).
    - logprobs: record each generated token's log-probability and the `logprobs` most likely alternatives
      (0..MAX_LOGPROBS; None = off). They are the model's own distribution (log-softmax of the raw logits),
      before penalties, temperature and filters, as vLLM reports them by default.
    - prompt_logprobs: also record the log-probability of every prompt token after the first (and as many
      alternatives as `logprobs` asks), e.g. to score a text.
    - logit_bias: {token id: bias} added to those tokens' logits first, before penalties, temperature and the
      filters (OpenAI's: biases in [-100, 100]; -100 bans a token, 100 all but forces it), greedy rows included.
      Stored as sorted (id, bias) pairs. The ids are checked against the vocabulary where it is known
      (`prepare_generation`).
    - json_schema: a JSON schema (a mapping, or its JSON text; stored as JSON text) the output must satisfy:
      each row's next-token mask comes from its grammar (`generation.grammar`, llguidance), and end-of-text or a
      stop token is allowed only where the JSON is complete. `JSON_OBJECT` is OpenAI's json_object mode. A row
      that reaches max_new_tokens first ends with finish reason "length" and incomplete JSON. None = free text.
    - grammar: a llguidance grammar (its Lark syntax, e.g. `LLMatcher.grammar_from_lark(...)`'s text) the output
      must match, applied as json_schema is (tool calls build theirs in `generation.tool_calls`). At most one of
      json_schema and grammar. None = free text.

    Frozen: the checks in __post_init__ hold for the object's whole life (use dataclasses.replace to vary one).
    """

    max_new_tokens: int = bounded(256, int, low=0, high=INT64_MAX, note="int64")
    temperature: float = bounded(1.0, low=0)
    top_k: int = bounded(0, int, low=0, high=INT64_MAX, note="int64")
    top_p: float = bounded(1.0, low=0, high=1, low_open=True)
    min_p: float = bounded(0.0, low=0, high=1)
    repetition_penalty: float = bounded(1.0, low=0, low_open=True)
    frequency_penalty: float = bounded(0.0)
    presence_penalty: float = bounded(0.0)
    seed: int | None = bounded(None, int, low=INT64_MIN, high=INT64_MAX, optional=True, note="int64")
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eot: bool = False
    logprobs: int | None = bounded(None, int, low=0, high=MAX_LOGPROBS, optional=True)
    prompt_logprobs: bool = False
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
    json_schema: Mapping[str, Any] | str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        # normalize first, so that the checks (and everybody after them) see one spelling of each setting
        for name in ("stop", "stop_token_ids"):  # a number or None from Python would fail to iterate below
            if not isinstance(getattr(self, name), Iterable):
                raise InvalidSamplingParam(name, getattr(self, name), "must be a list")
        stop_ids = tuple(_as_int(t) for t in self.stop_token_ids)
        if any(t is None or t < 0 for t in stop_ids):
            raise InvalidSamplingParam("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        normalized = {
            "top_k": 0 if self.top_k is None else self.top_k,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop),
            "stop_token_ids": stop_ids,
            "logit_bias": _bias_pairs(self.logit_bias),
            "json_schema": _schema_text(self.json_schema),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)  # frozen: __setattr__ itself refuses
        self._check()

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], **overrides: Any) -> SamplingParams:
        """Params from the entries of `fields` named like SamplingParams fields (others are ignored), then
        `overrides`: the command line passes `vars(args)`, the server a request's `model_dump()` plus what it
        derives itself (max_new_tokens, stop, ...)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - names
        if unknown:  # a typo in an override would otherwise be dropped silently
            raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}")
        return cls(**{**{k: v for k, v in fields.items() if k in names}, **overrides})

    def _check(self) -> None:
        """Raise InvalidSamplingParam for the first setting out of its range: the bounds of the fields, then the
        lists' rules."""

        def require(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                raise InvalidSamplingParam(name, getattr(self, name), requirement)

        check_fields(self, error=InvalidSamplingParam)  # the ranges of single numbers, written beside the fields
        require(len(self.stop) <= MAX_STOPS, "stop", f"must hold at most {MAX_STOPS} strings")
        require(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
                f"must be non-empty strings of at most {MAX_STOP_CHARS} characters")
        require(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"must bias at most {MAX_LOGIT_BIAS} tokens")
        require(all(isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and _is_number(p[1])
                    and math.isfinite(p[1]) and abs(p[1]) <= LOGIT_BIAS_RANGE for p in self.logit_bias), "logit_bias",
                f"must map token ids (integers >= 0) to biases in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
        _check_schema(self.json_schema)
        _check_grammar(self.grammar)
        require(self.json_schema is None or self.grammar is None, "grammar", "cannot be given with json_schema")

    def constraint(self) -> tuple[str, str] | None:
        """(field, llguidance grammar) of the output's form: json_schema's or grammar; None for free text."""
        if self.json_schema is not None:
            return "json_schema", json_grammar(self.json_schema)
        return None if self.grammar is None else ("grammar", self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
