"""A multi-turn conversation with one model: messages in, the reply streamed out, the history kept to the context.

A chat model reads the whole conversation every turn, rendered by its chat template
(`gptlab.tokenizer.chat_template`), so a session has four jobs beyond one call of the engine:

* **Keeping the conversation inside the context.** The rendered conversation plus the reply's budget
  (`max_new_tokens`) must fit the model's `block_size`. When it does not, the oldest user/assistant turns are
  dropped (for good, and never the system message) and the caller is told through `on_notice`; when the new
  user message does not fit even after the system message alone, it is refused (`MessageTooLongError`) and not
  stored (one longer than `prompts.prompt_char_limit` characters before it is tokenized).
* **Knowing where a reply ends.** At the tokenizer's end-of-turn token (`eot_id`, which the engine stops at), at
  the built-in template's stop strings ("\\nUser:" for "plain", "<|im_end|>" for "chatml"), and at the text a
  template writes after an assistant message (its end-of-turn marker, e.g. "<|eot_id|>" or "<end_of_turn>",
  found by rendering a sample turn), for models whose marker is not their end-of-text token. The detokenizer
  holds back text that may still become a stop string, so a stop string is never streamed nor stored.
* **Storing what the user saw.** Whitespace around a reply is dropped (under "plain" the model writes the space
  after "Assistant:", and the template writes its own; trailing whitespace is held back while streaming). A
  reply abandoned while streaming (Ctrl-C, or the caller closes the iterator) is stored as far as it was
  handed out; one abandoned before any text leaves no turn at all.
* **Not paying for the model's size, nor the conversation's length, every turn.** One `Engine` (one KV cache, one
  set of packed CPU weights) is kept across turns and only regrown when a longer conversation needs more cache;
  its `PrefixCache`, kept across engines, holds the keys and values of every turn so far (the prompt, and the reply
  as generated: reused as far as the next rendering repeats its tokens), so a turn prefills only what the last one
  did not compute, e.g. the template's end of the reply and the new message (`prefix_cache_mb=0` turns it off:
  every turn then prefills the whole conversation).

Nothing here prints or parses flags: `gptlab chat` (`gptlab.cli.chat`) is the terminal around it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING

from gptlab.errors import GptlabError
from gptlab.generation.api import PACK_MIN_TOKENS, stream_deltas
from gptlab.generation.engine import Engine
from gptlab.generation.params import SamplingParams
from gptlab.generation.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixCache
from gptlab.generation.prompts import prompt_char_limit
from gptlab.generation.request import Generation
from gptlab.model import GPT
from gptlab.tokenizer.chat_template import ChatTemplate, chat_template_for, reply_stops

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

Message = dict[str, str]
DEFAULT_REPLY_TOKENS = 512  # per reply, at most half the context (default_max_new_tokens)


class MessageTooLongError(GptlabError):
    """The new user message does not fit the context even with every earlier turn dropped; it was not stored."""


def default_max_new_tokens(block_size: int) -> int:
    """A reply budget that leaves at least half of the context to the conversation."""
    return max(1, min(DEFAULT_REPLY_TOKENS, block_size // 2))


class ChatSession:
    """A conversation with `model`: `send(text)` streams the reply to a user message and records the turn.

    `template` is a built-in template's name ("plain", "chatml"), a `ChatTemplate`, or None for the tokenizer's
    own (else "plain"). `params` default to SamplingParams' defaults with `default_max_new_tokens`; their `stop`
    strings are kept and the template's are added. `on_notice` receives one-line notes (turns dropped to fit).
    `prefix_cache_mb`: the budget of the keys and values kept between turns (0: none).
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: TextTokenizer,
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        template: str | ChatTemplate | None = None,
        on_notice: Callable[[str], None] | None = None,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.block_size = int(model.config.block_size)
        self.template = template if isinstance(template, ChatTemplate) else chat_template_for(tokenizer, template)
        params = params or SamplingParams(max_new_tokens=default_max_new_tokens(self.block_size))
        if not 1 <= params.max_new_tokens < self.block_size:
            raise GptlabError(
                f"a reply of up to {params.max_new_tokens} new tokens leaves no room for the conversation in the "
                f"model's context of {self.block_size} tokens: allow between 1 and {self.block_size - 1}"
            )
        self.params = dataclasses.replace(params, stop=reply_stops(self.template, params.stop))
        self.system = system
        self.turns: list[Message] = []  # user and assistant messages, alternating, oldest first
        self.on_notice = on_notice
        # the built-in "plain" template has no special tokens: its text is encoded as plain text
        self._special = self.template.name != "plain"
        self._engine: Engine | None = None
        self.prefix_cache = PrefixCache.of_megabytes(prefix_cache_mb)  # outlives the engines (see the docstring)
        self._replies = 0  # replies started: each one's sample index, so a seeded session varies between turns
        self._stream_open: Generator[str, None, None] | None = None

    # --- the conversation -----------------------------------------------------------------------------------
    @property
    def messages(self) -> list[Message]:
        """The conversation as the template sees it: the system message (if any), then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.turns]

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.turns.clear()

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of `messages` rendered with the assistant's opening, ready to be continued."""
        text = self.template.render(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, allow_special=self._special)

    def fit(self, text: str) -> list[int]:
        """The prompt for the conversation so far plus the user message `text`, after dropping the oldest turns
        until it leaves `max_new_tokens` of the context free. Raises MessageTooLongError (dropping nothing)
        when `text` does not fit even alone."""
        if len(text) > prompt_char_limit(self.block_size):  # (`prompts`: never tokenized, once per dropped turn)
            raise MessageTooLongError(
                f"the message has {len(text):,} characters, more than the model's context of {self.block_size} "
                "tokens can hold; it was dropped"
            )
        budget = self.block_size - self.params.max_new_tokens
        user = {"role": "user", "content": text}
        head = self.messages[: 1 if self.system else 0]
        dropped = 0
        while True:
            ids = self.prompt_ids(head + self.turns[2 * dropped :] + [user])
            if len(ids) <= budget or 2 * dropped >= len(self.turns):
                break
            dropped += 1
        if len(ids) > budget:
            with_system = " with the system message" if self.system else ""
            raise MessageTooLongError(
                f"the message does not fit the model's context: {len(ids)} tokens{with_system} + "
                f"{self.params.max_new_tokens} for the reply > {self.block_size}; it was dropped"
            )
        if dropped:
            del self.turns[: 2 * dropped]
            if self.on_notice is not None:
                self.on_notice(
                    f"dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} of the conversation to fit the "
                    f"model's context of {self.block_size} tokens"
                )
        return ids

    # --- replies --------------------------------------------------------------------------------------------
    def send(self, text: str) -> Generator[str, None, None]:
        """Add the user message `text` and stream the reply in text deltas; the turn is recorded when the
        stream ends or is closed (a previous reply still streaming is closed first). The prompt is built (and too
        long a message refused) before this returns."""
        if self._stream_open is not None:
            self._stream_open.close()
        ids = self.fit(text)
        engine = self._engine_for(len(ids))
        gen = engine.prepare(ids, self.params, sample_index=self._replies)
        self._replies += 1
        self._stream_open = self._stream(engine, gen, text)
        return self._stream_open

    def ask(self, text: str) -> str:
        """The whole reply to the user message `text` (as `send`, without streaming)."""
        return "".join(self.send(text))

    def _stream(self, engine: Engine, gen: Generation, text: str) -> Generator[str, None, None]:
        shown: list[str] = []  # deltas handed out
        held = ""  # trailing whitespace, handed out only when more text follows it
        finished = False
        try:
            for delta in stream_deltas(engine, gen):
                if not shown and not held:
                    delta = delta.lstrip()
                body = (held + delta).rstrip()
                held = (held + delta)[len(body) :]
                if body:
                    shown.append(body)
                    yield body
            finished = True
        finally:
            if not finished:  # interrupted, perhaps inside a forward: start the next reply on a fresh engine
                engine.release(gen)
                self._engine = None
            self._stream_open = None
            reply = "".join(shown)
            if finished or reply:
                self.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]

    def _engine_for(self, prompt_len: int) -> Engine:
        """The session's engine, with cache for this prompt and its reply (grown by doubling, up to the
        context, so that a growing conversation reallocates only a few times)."""
        need = min(self.block_size, prompt_len + self.params.max_new_tokens)
        if self._engine is None or self._engine.max_len < need:
            size = need if self._engine is None else min(self.block_size, max(need, 2 * self._engine.max_len))
            self._engine = Engine(self.model, max_batch=1, tokenizer=self.tokenizer, max_len=size,
                                  pack_weights=self.params.max_new_tokens >= PACK_MIN_TOKENS,
                                  prefix_cache=self.prefix_cache)
        return self._engine
