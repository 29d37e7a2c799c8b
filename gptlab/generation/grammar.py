"""Structured outputs: each row's JSON schema as a grammar, and the next-token masks it allows.

The grammar library is llguidance (the `structured` extra): it compiles a JSON schema lazily, in about a
millisecond, walks any tokenizer's vocabulary as bytes, and computes a row's mask in microseconds (measured against
xgrammar and outlines-core by `benchmarks/structured_overhead.py --libraries`; the README says why it was chosen).

* `grammar_vocabulary(tokenizer)`: llguidance's view of a gptlab tokenizer (every token's bytes), built once per
  tokenizer. Its end-of-sequence token is one past the tokenizer's vocabulary, a token no model writes: which of a
  row's own stop tokens may end it is decided here, from the grammar's accepting state, for every tokenizer alike.
* `RowGrammar`: one row's matcher: the tokens it consumed, whether the JSON is complete (`accepting`), whether
  nothing may follow (`done`, the row then ends with finish reason "stop"), and whether one token may come next
  (`allows`).
* `allowed_tokens(grammars, vocab_size)`: the (rows, vocab) 0/1 mask of a batch's constrained rows, each row's
  bits written by llguidance into one array. `sampling.sample_next` asks it for the rows that filter their
  logits, and for the others only where the token they drew unmasked is one their grammar forbids.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gptlab.errors import GptlabError
from gptlab.generation.params import InvalidSamplingParam, schema_start

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer


class GrammarDeadEnd(GptlabError):
    """A row's grammar allows no token of the model's vocabulary (it cannot go on, nor end)."""


def matcher_error(matcher: Any) -> str:
    """llguidance's error as one line: its first (it goes on with the parser's state and the whole grammar)."""
    lines = matcher.get_error().strip().splitlines()
    return lines[0] if lines else "unknown error"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # SamplingParams refuses a schema first; this is for a caller that skipped it
        raise GptlabError("structured outputs need the llguidance package: pip install 'gptlab[structured]'") from None
    return llguidance


class _TokenizerView:
    """What llguidance reads of a tokenizer: every token's bytes, the special ones, and an encoder."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        n = tokenizer.vocab_size
        # a token's bytes after an anchor token: some tokenizers (SentencePiece) decode a first token differently
        anchor = len(tokenizer.decode_bytes([0]))
        self.tokens = [tokenizer.decode_bytes([0, i])[anchor:] for i in range(n)] + [b"<|gptlab-end|>"]
        self.eos_token_id, self.bos_token_id = n, None  # the virtual end token (see the module docstring)
        eot = getattr(tokenizer, "eot_id", None)
        self.special_token_ids = [n] + ([eot] if eot is not None else [])
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes whether bytes are taken: they are not
            raise TypeError("text only")
        return self._encode(text)


@functools.lru_cache(maxsize=8)
def grammar_vocabulary(tokenizer: TextTokenizer) -> Any:
    """llguidance's tokenizer for `tokenizer` (tens of milliseconds for a 50k vocabulary: built once)."""
    llg = _llguidance()
    return llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerView(tokenizer)))


class RowGrammar:
    """One row's grammar state: a matcher that consumed the row's tokens so far, and the row's stop tokens (allowed
    only where the grammar accepts)."""

    def __init__(self, matcher: Any, stop_ids: frozenset[int], vocab_size: int, field: str = "json_schema") -> None:
        self.matcher, self.stop_ids, self.vocab_size, self.field = matcher, stop_ids, vocab_size, field

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing may follow: the output is complete."""
        return self.matcher.is_stopped()

    def allows(self, token: int) -> bool:
        """Whether `token` may come next: what `allowed_tokens` says of it, for one token (a few microseconds,
        where a mask walks the whole vocabulary)."""
        if token in self.stop_ids:
            return self.accepting
        return token < self.vocab_size and self.matcher.validate_tokens([token]) == 1

    def advance(self, token: int) -> bool:
        """Consume the row's new token (one the mask allowed); True when the output is then complete."""
        if not self.matcher.consume_token(token):  # the mask allowed it: the matcher went past its limits
            raise InvalidSamplingParam(self.field, f"(token {token})", "is too large for gptlab's grammar engine: "
                                       f"{matcher_error(self.matcher)}")
        return self.done


def row_grammar(constraint: tuple[str, str], tokenizer: TextTokenizer | None, stop_ids: frozenset[int]) -> RowGrammar:
    """A row's grammar for `SamplingParams.constraint()`: (the field it came from, llguidance grammar text, checked
    by SamplingParams); InvalidSamplingParam naming that field when this tokenizer cannot write any text the
    grammar allows. A copy (a microsecond) of the checked start kept for each recent grammar and tokenizer:
    clients send the same schema again and again, and compiling it and checking its first mask took ~0.6 ms."""
    field, grammar_text = constraint
    if tokenizer is None:
        raise ValueError(f"{field} needs a tokenizer: the grammar reads tokens as text")
    start = _checked_start(grammar_vocabulary(tokenizer), grammar_text, field, stop_ids, tokenizer.vocab_size)
    return RowGrammar(start.deep_copy(), stop_ids, tokenizer.vocab_size, field)


@functools.lru_cache(maxsize=64)
def _checked_start(vocab: Any, grammar_text: str, field: str, stop_ids: frozenset[int], vocab_size: int) -> Any:
    """A matcher of `grammar_text` over `vocab` that has consumed nothing, checked: the grammar compiles, some
    token (or, where it accepts the empty output, a stop token) can start it, and its first mask stays within
    llguidance's limits. Only the matchers that pass are kept (an error is raised again each time)."""
    matcher = _llguidance().LLMatcher(vocab, grammar_text, log_level=0)
    if matcher.is_error():
        why = f"is not a {field.replace('json_', '')} gptlab can enforce: {matcher_error(matcher)}"
        raise InvalidSamplingParam(field, schema_start(grammar_text), why)
    try:
        allowed_tokens([RowGrammar(matcher, stop_ids, vocab_size, field)], vocab_size)
    except GrammarDeadEnd:
        why = "cannot be written in this model's vocabulary: no token starts an output it allows"
        raise InvalidSamplingParam(field, schema_start(grammar_text), why) from None
    if matcher.is_error():  # the first mask already went past llguidance's limits (a row of too many items)
        why = f"is too large for gptlab's grammar engine: {matcher_error(matcher)}"
        raise InvalidSamplingParam(field, schema_start(grammar_text), why)
    _check_forced_start(matcher, grammar_text, field, stop_ids, vocab_size)
    return matcher


def _check_forced_start(matcher: Any, grammar_text: str, field: str, stop_ids: frozenset[int],
                        vocab_size: int) -> None:
    """Walk a copy of the matcher through the tokens its grammar forces from the start (a tool call's
    `<tool_call>{"name": "f", "arguments": {`), masking where each run ends: a grammar that goes past llguidance's
    limits there is refused now, not after the row's prompt (the tools' schemas, tens of thousands of tokens) was
    prefilled. A few milliseconds, once per grammar (the start is kept)."""
    walker = matcher.deep_copy()
    for _ in range(FORCED_RUNS):
        forced = walker.compute_ff_tokens()
        if not forced or walker.is_stopped():
            return
        walker.consume_tokens(forced)
        try:
            if not walker.is_error() and not walker.is_stopped():
                allowed_tokens([RowGrammar(walker, stop_ids, vocab_size, field)], vocab_size)
        except GrammarDeadEnd:
            why = "cannot be written in this model's vocabulary: no token continues its forced start"
            raise InvalidSamplingParam(field, schema_start(grammar_text), why) from None
        if walker.is_error():
            why = f"is too large for gptlab's grammar engine: {matcher_error(walker)}"
            raise InvalidSamplingParam(field, schema_start(grammar_text), why)


FORCED_RUNS = 8  # forced runs walked at most (one usually: it ends where the output may branch)


def allowed_bits(grammars: Sequence[RowGrammar], vocab_size: int) -> np.ndarray:
    """The (len(grammars), words) uint32 bitmask of the tokens each grammar allows next, token t at bit t % 32 of
    word t // 32 (little-endian, as llguidance writes it; words cover vocab_size): its own tokens, and its stop
    tokens where the JSON is complete. Tokens past the tokenizer's vocabulary (a padded model's) never are.

    Batched after llguidance (one array of bits, one check): a per-row pass over a 50k vocabulary cost more than the
    masks themselves."""
    n, end = len(grammars), grammars[0].vocab_size
    words = (max(vocab_size, end + 1) + 31) // 32  # llguidance's vocabulary: the tokenizer's + the virtual end token
    llg_words = (end + 1 + 31) // 32
    bits = np.zeros((n, words), dtype=np.uint32)
    for i, g in enumerate(grammars):  # one after the other: llguidance's pool (LLExecutor, 2 threads) took 2-4x
        # as long at 4-64 rows of GPT-2's vocabulary on 2 cores (a mask is ~5-20 us; handing rows out cost more)
        g.matcher.unsafe_compute_mask_ptr(bits.ctypes.data + i * words * 4, llg_words * 4)
    known = min(vocab_size, end)  # never the virtual end (stops are ours), nor a token past the vocabulary
    bits[:, known // 32] &= np.uint32((1 << (known % 32)) - 1)
    bits[:, known // 32 + 1 :] = 0
    accepting = {}  # rows with stop tokens in the vocabulary: whether their JSON is complete (asked once a row)
    for i, g in enumerate(grammars):
        stops = [t for t in g.stop_ids if t < vocab_size]
        if stops:
            accepting[i] = g.accepting
        for t in stops:
            bit = np.uint32(1 << (t % 32))
            bits[i, t // 32] = bits[i, t // 32] | bit if accepting[i] else bits[i, t // 32] & ~bit
    # a dead end: no bit set in the row's words (32x less to read than the mask), and no stop token allowed
    dead = [i for i in np.flatnonzero(~bits.any(axis=1)).tolist() if not accepting.get(i, False)]
    if dead:
        g = grammars[dead[0]]
        raise GrammarDeadEnd(f"no token of the vocabulary continues the row's JSON ({matcher_error(g.matcher)})")
    return bits


def allowed_tokens(grammars: Sequence[RowGrammar], vocab_size: int) -> torch.Tensor:
    """The (len(grammars), vocab_size) mask of the tokens each grammar allows next (1, else 0: uint8, which torch
    turns into fp32 in a third of a bool mask's time): `allowed_bits`, unpacked."""
    return unpack_bits(allowed_bits(grammars, vocab_size), vocab_size)


def unpack_bits(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """`allowed_bits`' rows as (n, vocab_size) uint8 masks: 1 where the token is allowed, else 0."""
    return torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size])
