"""One prompt policy for every entry point (`gptlab.generation.prompts`): `gptlab sample` and the server refuse a
text too long for the context at the same number of characters, and both start an empty prompt from end-of-text
or refuse it with the same reason."""

from __future__ import annotations

import httpx
import pytest
from helpers import ByteTokenizer, tiny_model

from gptlab.cli.sample import _prompt_ids, bound_prompt
from gptlab.errors import GptlabError
from gptlab.generation.prompts import MAX_CHARS_PER_TOKEN, EmptyPromptError, prompt_char_limit, start_ids

pytest.importorskip("fastapi")
from gptlab.serve import ServerThread, create_app  # noqa: E402

BLOCK = 16


class WithEndOfText(ByteTokenizer):
    eot_id = 0


NoEndOfText = ByteTokenizer  # eot_id None


@pytest.fixture(scope="module")
def servers():
    with ServerThread(create_app(tiny_model(vocab_size=256, block_size=BLOCK), WithEndOfText(), model_name="m",
                                 max_batch=1, ui=False)) as with_eot, \
         ServerThread(create_app(tiny_model(vocab_size=256, block_size=BLOCK), NoEndOfText(), model_name="m",
                                 max_batch=1, ui=False)) as without_eot:
        yield with_eot, without_eot


def _complete(server, prompt: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2,
                                                           "temperature": 0}, timeout=60)


def test_too_long_a_text_is_refused_at_the_same_length(servers) -> None:
    limit = prompt_char_limit(BLOCK)
    assert limit == BLOCK * MAX_CHARS_PER_TOKEN
    assert bound_prompt("a" * limit, BLOCK, truncate=False) == "a" * limit  # the characters may still fit
    with pytest.raises(GptlabError, match="more than the model's context"):
        bound_prompt("a" * (limit + 1), BLOCK, truncate=False)
    assert bound_prompt("b" + "a" * limit, BLOCK, truncate=True) == "a" * limit  # its end kept
    r = _complete(servers[0], "a" * (limit + 1))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = _complete(servers[0], "a" * limit)  # past the characters' check, refused on its tokens
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_an_empty_prompt_starts_from_end_of_text_or_is_refused_alike(servers) -> None:
    assert start_ids([], 0) == [0] and start_ids([5, 6], 0) == [5, 6]
    assert _prompt_ids("", WithEndOfText()) == [0]
    assert _complete(servers[0], "").status_code == 200
    with pytest.raises(EmptyPromptError) as refused:
        start_ids([], None)
    reason = str(refused.value)
    with pytest.raises(GptlabError, match="--prompt TEXT") as cli:
        _prompt_ids("", NoEndOfText())
    assert reason in str(cli.value)
    r = _complete(servers[1], "")
    assert r.status_code == 400 and r.json()["error"]["message"] == reason
