"""Incremental detokenization for streaming: token ids in, whole characters out, stop strings held back.

Two problems make "decode each new token and print it" wrong:

* A byte-level tokenizer may split one character over several tokens (an emoji is 4 UTF-8 bytes). We decode
  the raw bytes of each token (`tokenizer.decode_bytes`) through an incremental UTF-8 decoder, which keeps an
  incomplete character until its last byte arrives.
* Some tokenizers decode a token differently at the start of a sequence (SentencePiece drops a leading space).
  So the bytes of a new token are taken as decode_bytes(context + new) minus decode_bytes(context), with a few
  earlier tokens (at first: the end of the prompt) as context.

Stop strings may also span tokens: text that could be the beginning of a stop string is held back until it
either completes the stop string (then it is dropped, with everything after it) or stops matching.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

_CONTEXT = 4  # earlier tokens decoded with each new one


class TextState:
    """The text of one generation, built one token at a time."""

    def __init__(self, tokenizer: TextTokenizer, context_ids: Sequence[int] = (), stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids = list(context_ids[-_CONTEXT:])
        self._context_bytes = len(tokenizer.decode_bytes(self._ids)) if self._ids else 0
        self.text = ""  # generated text so far (cut at a stop string once one is found)
        self._sent = 0  # characters of `text` handed out by pop_delta
        self.stopped = False
        self.closed = False

    def push(self, token: int) -> bool:
        """Add one generated token; True if the text now holds a stop string (the text is cut before it)."""
        if self.closed:
            return self.stopped
        self._ids.append(int(token))
        raw = self.tokenizer.decode_bytes(self._ids)
        new_bytes = raw[self._context_bytes :]
        if len(self._ids) > 2 * _CONTEXT:  # keep the context short: decoding stays O(1) per token
            self._ids = self._ids[-_CONTEXT:]
            self._context_bytes = len(self.tokenizer.decode_bytes(self._ids))
        else:
            self._context_bytes = len(raw)
        self._add(self._decoder.decode(new_bytes))
        return self.stopped

    def _add(self, text: str) -> None:
        """Append decoded text; cut the text at a stop string that ends in it, and close."""
        before = len(self.text)
        self.text += text
        if self.stop:
            # a stop string that ends in the new text starts at most longest_stop - 1 characters before it
            start = max(0, before - self._longest_stop + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                self.closed = True

    def close(self) -> None:
        """No more tokens: flush an incomplete last character (as U+FFFD, which may complete a stop string) unless
        a stop string ended the text."""
        if not self.closed and not self.stopped:
            self._add(self._decoder.decode(b"", final=True))
        self.closed = True

    def pop_delta(self, final: bool = False) -> str:
        """The text not handed out yet, less a tail that may still grow into a stop string (unless final)."""
        end = len(self.text)
        if not (final or self.closed) and self.stop:
            end -= self._held_back()
        delta = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.text
        for n in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
