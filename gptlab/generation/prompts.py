"""What every entry point (`gptlab sample`, `gptlab chat`, the server) does with a prompt before the engine sees it,
written once. Torch-free: the command line reads it before torch is imported.

* A text longer than `prompt_char_limit(block_size)` characters cannot fit the context whatever the tokenizer (no
  token of a real vocabulary is longer than MAX_CHARS_PER_TOKEN characters; GPT-2's longest is 128 bytes): it is
  refused, or cut to its end, before it is tokenized (a 50 MB prompt would take minutes to tokenize only to be
  refused). The engine then checks the tokens against the context exactly.
* An empty prompt starts from the end-of-text token (`start_ids`), as nanoGPT's sample.py does; a tokenizer without
  one cannot start from nothing (`EmptyPromptError`).
* A text prompt gets BOS first where the model's own tokenizer puts it before every text (`text_prompt_ids`:
  Llama's post-processor, `Tokenizer.adds_bos`), as transformers encodes `tokenizer(prompt)`; an empty one is then
  BOS alone. Token ids a caller gives are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gptlab.errors import GptlabError

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

MAX_CHARS_PER_TOKEN = 1024


class EmptyPromptError(GptlabError, ValueError):
    """An empty prompt, and a tokenizer with no end-of-text token to start from."""


def prompt_char_limit(block_size: int) -> int:
    """The most characters a prompt for a context of `block_size` tokens may have before it is tokenized."""
    return block_size * MAX_CHARS_PER_TOKEN


def start_ids(ids: Sequence[int], eot_id: int | None) -> list[int]:
    """The prompt's token ids, or for an empty prompt the end-of-text token alone."""
    if ids:
        return list(ids)
    if eot_id is None:
        raise EmptyPromptError("the prompt is empty and this tokenizer has no end-of-text token to start from")
    return [eot_id]


def with_bos(ids: Sequence[int], tokenizer: TextTokenizer) -> list[int]:
    """A text prompt's ids (its `encode`) as the model's own tokenizer encodes it: BOS first where that puts it
    first (a prompt that already starts with it keeps one)."""
    bos = getattr(tokenizer, "bos_id", None)
    if bos is not None and getattr(tokenizer, "adds_bos", False) and not (ids and ids[0] == bos):
        return [bos, *ids]
    return list(ids)


def text_prompt_ids(ids: Sequence[int], tokenizer: TextTokenizer) -> list[int]:
    """A text prompt's ids `with_bos`, then as `start_ids` (an empty prompt from end-of-text where no BOS comes)."""
    return start_ids(with_bos(ids, tokenizer), getattr(tokenizer, "eot_id", None))
