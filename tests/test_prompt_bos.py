"""A text prompt is tokenized as the model's own tokenizer tokenizes it: where that puts BOS first (Llama's
post-processor, `Tokenizer.adds_bos`), `gptlab sample` feeds BOS first, as transformers' generate does on
`tokenizer(prompt)`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import corpus_text, hf_llama_dir

from gptlab.tokenizer import CharTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_llama_dir(tmp_path_factory.mktemp("bos") / "llama", corpus_text(3000), block_size=64, vocab_size=300)


def _greedy_text(directory: Path, prompt: str, new_tokens: int) -> str:
    """transformers' greedy continuation of `prompt`, encoded by the model's own tokenizer (BOS and all)."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id  # the reference does put BOS first
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in new:  # gptlab ends a row at end-of-text and does not print it; other special tokens it does
        new = new[: new.index(tok.eos_token_id)]
    return tok.decode(new)


@pytest.mark.parametrize("prompt", ["To be, or not", ""])
def test_sample_puts_bos_first_as_the_models_tokenizer_does(llama: Path, prompt: str, capsys) -> None:
    from gptlab.cli import main
    from gptlab.cli.sample import SEPARATOR

    n = 8
    assert main(["sample", str(llama), "--prompt", prompt, "--max-new-tokens", str(n), "--temperature", "0",
                 "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == prompt + _greedy_text(llama, prompt, n) + SEPARATOR


def test_start_ids_adds_bos_once_and_only_where_the_tokenizer_does(llama: Path) -> None:
    from gptlab.generation.prompts import text_prompt_ids

    tok = load_tokenizer(llama)
    assert tok.adds_bos and tok.bos_id is not None
    hello = tok.encode("hello")
    assert text_prompt_ids(hello, tok) == [tok.bos_id, *hello]
    assert text_prompt_ids([tok.bos_id, *hello], tok) == [tok.bos_id, *hello]  # a prompt that starts with BOS keeps one
    assert text_prompt_ids([], tok) == [tok.bos_id]  # an empty prompt starts from BOS, not from end-of-text
    char = CharTokenizer("ab")
    assert text_prompt_ids([0, 1], char) == [0, 1]


def test_served_completion_puts_bos_first_but_not_before_given_token_ids(llama: Path) -> None:
    pytest.importorskip("fastapi")
    import httpx

    from gptlab.loading import load_model
    from gptlab.serve import ServerThread, create_app

    model, tokenizer = load_model(llama, dtype="float32")
    prompt, n = "To be, or not", 8
    with ServerThread(create_app(model, tokenizer, max_batch=2)) as server:
        def complete(given: str | list[int]) -> dict:
            body = {"model": "gptlab", "prompt": given, "max_tokens": n, "temperature": 0}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()

        text = complete(prompt)
        assert text["choices"][0]["text"] == _greedy_text(llama, prompt, n)
        ids = tokenizer.encode(prompt)
        assert text["usage"]["prompt_tokens"] == len(ids) + 1  # BOS counted, as the model read it
        assert complete(ids)["usage"]["prompt_tokens"] == len(ids)  # token ids are the caller's: left as they are
