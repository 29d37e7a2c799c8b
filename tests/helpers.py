"""Helpers the tests share: where the offline data lives, tiny models and tokenizers, small data sets and recipes,
and the check that a command failed with one clean line. Import them as `from helpers import ...`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import random
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlab import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
# Real data files, present only where shared/data sits beside the repository (this project's CI clones it there);
# the tests that need them skip without them (`needs_shakespeare`, `needs_gpt2_bpe`), the rest use CORPUS.
SHARED_DATA = REPO.parent / "shared" / "data"
TINY_SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
GPT2_FILES = SHARED_DATA / "gpt2"  # encoder.json + vocab.bpe: OpenAI's original GPT-2 BPE files
TIKTOKEN_CACHE = SHARED_DATA / "tiktoken_cache"
# a 6.6 KB play-like text committed with the tests (tests/data/README.md): what every test that needs "some text"
# reads, so a fresh clone runs them
CORPUS = REPO / "tests" / "data" / "corpus.txt"

needs_shakespeare = pytest.mark.skipif(
    not TINY_SHAKESPEARE.is_file(),
    reason=f"checks figures of the real tiny Shakespeare: needs {TINY_SHAKESPEARE} (the project's shared/data "
    "beside the clone)",
)


# --- text and GPT-2's BPE files -----------------------------------------------------------------------------------
@functools.cache
def corpus_text(chars: int | None = None) -> str:
    """CORPUS's text, or its first `chars` characters where it has that many; past its length, its speeches
    (blank-line separated) again in a fixed shuffled order per round, so any length is the same text everywhere."""
    text = CORPUS.read_text(encoding="utf-8")
    if chars is None or chars <= len(text):
        return text if chars is None else text[:chars]
    speeches = text.strip("\n").split("\n\n")
    rng, parts, size = random.Random(0), [text], len(text)
    while size < chars:
        order = rng.sample(speeches, len(speeches))
        more = "\n" + "\n\n".join(order) + "\n"
        parts.append(more)
        size += len(more)
    return "".join(parts)[:chars]


def tiktoken_cache_dir() -> Path:
    """The folder tiktoken reads its cached files from (tiktoken.load.read_file_cached's rule)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return Path(os.environ[var])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def gpt2_bpe_files() -> tuple[Path, Path] | None:
    """(encoder.json, vocab.bpe): OpenAI's GPT-2 BPE files, from GPT2_FILES or else tiktoken's cache (which holds
    the same bytes under the SHA-1 of their URLs); None where neither has them. Where this is None, tiktoken's
    `gpt2` encoding would be downloaded: the tests that need it skip instead (no test uses the network)."""
    if (GPT2_FILES / "encoder.json").is_file() and (GPT2_FILES / "vocab.bpe").is_file():
        return GPT2_FILES / "encoder.json", GPT2_FILES / "vocab.bpe"
    cache = tiktoken_cache_dir()
    files = tuple(cache / hashlib.sha1((_GPT2_URL + name).encode()).hexdigest() for name in ("encoder.json",
                                                                                             "vocab.bpe"))
    return files if all(f.is_file() for f in files) else None  # type: ignore[return-value]


GPT2_SKIP_REASON = ("needs GPT-2's BPE files offline: set TIKTOKEN_CACHE_DIR to a folder with tiktoken's cached gpt2 "
                    "files (this project's CI has them in shared/data/tiktoken_cache beside the clone)")
if TIKTOKEN_CACHE.is_dir():  # before anything loads tiktoken's gpt2 (conftest imports this module first)
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))


def tiktoken_has_gpt2() -> bool:
    """Whether tiktoken's `gpt2` encoding loads here without the network (its two files are in its cache)."""
    cache = tiktoken_cache_dir()
    return all((cache / hashlib.sha1((_GPT2_URL + name).encode()).hexdigest()).is_file()
               for name in ("encoder.json", "vocab.bpe"))


# tests that load tiktoken's gpt2 (the `gpt2` fixture skips by itself) or read GPT-2's BPE files
needs_gpt2_bpe = pytest.mark.skipif(not tiktoken_has_gpt2() and gpt2_bpe_files() is None, reason=GPT2_SKIP_REASON)
needs_tiktoken_gpt2 = pytest.mark.skipif(not tiktoken_has_gpt2(), reason=GPT2_SKIP_REASON)


# --- command-line results ---------------------------------------------------------------------------------------
class Hang(BaseException):
    """A row that did not answer in time (a BaseException: no handler of the command line may turn it into a
    clean-looking error line)."""


@contextlib.contextmanager
def time_bound(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body takes longer than `seconds`."""

    def expire(signum: int, frame: object) -> None:
        raise Hang(f"no answer within {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def cli_outcome(argv: list[str], seconds: int) -> tuple[int, list[str]]:
    """(exit code, stderr's lines) of one in-process command line (`gptlab.cli.main`, argparse's own refusals
    included), bounded in time; stdout is dropped."""
    from gptlab.cli import main

    err = io.StringIO()
    with time_bound(seconds), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own refusals: usage line + one error line, exit 2
            rc = int(e.code or 0)
    return rc, err.getvalue().splitlines()


def one_line_error(rc: int, err: str, notes: int = 0) -> str:
    """The CLI's exit code 2 and a single `error:` line (after `notes` progress lines), no traceback."""
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == notes + 1 and lines[-1].startswith("error: "), err
    return lines[-1]


# --- models and tokenizers ----------------------------------------------------------------------------------------
def packed_mask(allowed: torch.Tensor) -> np.ndarray:
    """(n, V) bool -> (n, ceil(V / 32)) uint32 bits, token t at bit t % 32 of word t // 32: llguidance's layout, as
    `gptlab.generation.grammar.allowed_bits` returns it."""
    n, V = allowed.shape
    packed = np.zeros((n, (V + 31) // 32 * 4), dtype=np.uint8)
    packed[:, : (V + 7) // 8] = np.packbits(allowed.numpy(), axis=1, bitorder="little")
    return packed.view(np.uint32)


def attention_patterns(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits, each layer's attention weights (B, nh, T, T_k)): every layer's pattern hooked, so every layer
    runs the manual attention path."""
    from gptlab import run_with_cache

    names = [f"blocks.{i}.attn.hook_pattern" for i in range(model.config.n_layer)]
    logits, cache = run_with_cache(model, idx, names)
    return logits, [cache[name] for name in names]


def causal_attention_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, scale: float,
                          ) -> tuple[torch.Tensor, ...]:
    """Causal softmax attention in fp64 from the maths, kv heads repeated over their group: the output, its
    log-sum-exp and the gradients of q, k and v for the output's gradient `grad`."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    T = q.shape[2]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(group, 1)
    out.backward(grad.double())
    return out.detach(), scores.logsumexp(-1).detach(), q.grad, k.grad, v.grad


def tiny_model(
    position: str = "rope", block_size: int = 64, vocab_size: int = 256, seed: int = 0, **kw
) -> GPT:
    """A few-thousand-parameter random model; larger init so its greedy choices are not all the same token."""
    torch.manual_seed(seed)
    cfg = GPTConfig.preset(
        "tiny", position=position, block_size=block_size, vocab_size=vocab_size, init_std=0.3, **kw
    )
    return GPT(cfg).eval()


def char_checkpoint(path: Path) -> Path:
    """A tiny random model saved at `path` with a character tokenizer of lowercase letters and space."""
    from gptlab.checkpoint import save_model
    from gptlab.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    save_model(path, tiny_model(vocab_size=tok.vocab_size), tok)
    return path


def scripted_model(successor: dict[int, int], vocab_size: int, block_size: int = 64) -> GPT:
    """A model whose greedy next token after t is successor[t] whatever came before (tokens not in `successor`
    go to themselves): embeddings are one-hot, every block adds zero (its output projections are zero), so the
    LM
    head reads only the current token."""
    cfg = GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=1,
        n_head=1,
        n_embd=vocab_size,
        mlp_hidden=8,
        norm="rmsnorm",
        bias=False,
        position="rope",
        tie_embeddings=False,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wte.weight.copy_(torch.eye(vocab_size))
        model.transformer.ln_f.weight.fill_(1.0)
        for block in model.transformer.h:
            block.ln_1.weight.fill_(1.0)
            block.ln_2.weight.fill_(1.0)
        head = model.lm_head.weight
        for t in range(vocab_size):
            head[successor.get(t, t), t] = 1.0
    return model


def chain(ids: list[int]) -> dict[int, int]:
    """successor mapping that walks through `ids` in order (ids must be distinct)."""
    assert len(set(ids)) == len(ids)
    return dict(zip(ids, ids[1:], strict=False))


class ByteTokenizer:
    """Stand-in byte-level tokenizer: one token per UTF-8 byte, so multi-byte characters span tokens."""

    vocab_size = 256
    eot_id = None
    bos_id = None
    chat_template = None

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids) -> bytes:  # noqa: ANN001
        return bytes(int(i) for i in ids)

    def decode(self, ids, *, errors: str = "strict") -> str:  # noqa: ANN001
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def templated_byte_tokenizer(template: str | None) -> ByteTokenizer:
    """Bytes and an end-of-text token (256, which a grammar allows only at an end), with the chat template
    tests/data/templates/TEMPLATE.jinja (None: no template)."""

    class Tok(ByteTokenizer):
        vocab_size, eot_id = 257, 256
        chat_template = None if template is None else (REPO / "tests" / "data" / "templates" /
                                                       f"{template}.jinja").read_text()

        def decode_bytes(self, ids) -> bytes:  # noqa: ANN001
            return bytes(int(i) for i in ids if int(i) < 256)

    return Tok()


# --- training data and recipes ------------------------------------------------------------------------------------
# a 2-layer, width-32 model: a training step takes a few milliseconds
TINY_RECIPE = dict(
    model="tiny",
    n_embd=32,
    n_head=2,
    n_kv_head=2,
    block_size=32,
    batch_size=8,
    max_steps=40,
    optimizer="adamw",
    lr=3e-3,
    warmup_steps=5,
    schedule="cosine",
    log_interval=5,
    eval_interval=20,
    eval_tokens=2048,
    tensorboard=False,
    threads=1,
    seed=7,
)


def make_data(root: Path, chars: int = 60_000) -> Path:
    """A char-level DATA_DIR made from `chars` characters of the test corpus (90% train / 10% val)."""
    from gptlab.data import prepare

    root.mkdir(parents=True, exist_ok=True)
    text = root / "text.txt"
    text.write_text(corpus_text(chars), encoding="utf-8")
    out = root / "data"
    prepare([text], out, tokenizer="char")
    return out


def run_metric(run: Path, key: str) -> list[float]:
    """Every value of `key` (train_loss, val_loss, ...) a run logged to its metrics.jsonl, in order."""
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def write_recipe(root: Path, name: str = "tiny.toml", **changes: object) -> Path:
    """TINY_RECIPE with `changes`, as a TOML file."""
    lines = []
    for key, value in {**TINY_RECIPE, **changes}.items():
        text = (
            f'"{value}"'
            if isinstance(value, str)
            else str(value).lower()
            if isinstance(value, bool)
            else value
        )
        lines.append(f"{key} = {text}")
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return path


# --- record files -------------------------------------------------------------------------------------------------
def write_jsonl(path: Path, rows: list) -> Path:
    """`rows` as a .jsonl file, one JSON value per line."""
    import json

    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# preference pairs in each of the shapes `prepare` reads: strings, messages (a multi-turn prompt), implicit prompt
PAIRS = [
    {"prompt": "What is two plus two?", "chosen": "Four.", "rejected": "Five, I think."},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Sky colour?"}],
     "chosen": [{"role": "assistant", "content": "Blue"}], "rejected": [{"role": "assistant", "content": "Green"}]},
    {"chosen": [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "yes"}],
     "rejected": [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "no"}]},
    {"prompt": "Name a fruit.", "chosen": "An apple.", "rejected": "A chair."},
]


def pairs_data(root: Path, rows: list[dict] = PAIRS, block_size: int = 96) -> Path:
    """A char-level DATA_DIR of preference pairs (`rows`; the last quarter is the val split)."""
    from gptlab.data import prepare

    out = root / "pairs"
    prepare([write_jsonl(root / "pairs.jsonl", rows)], out, tokenizer="char", block_size=block_size,
            val_fraction=0.25)
    return out



def hf_llama_dir(directory: Path, text: str, block_size: int = 64, chat_template: str | None = None,
                 vocab_size: int = 400) -> Path:
    """A random Llama (n_layer 2, n_embd 32) saved by transformers, with a byte-level BPE trained on `text` whose
    encoding starts with <s> (as Llama's does) and end-of-text <|endoftext|>, and optionally a chat template."""
    import json

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i : i + 5000] for i in range(0, len(text), 5000)], trainer)
    eos, bos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|endoftext|>"}
    if chat_template:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=block_size, bos_token_id=bos,
        eos_token_id=eos, initializer_range=0.3,  # peaked distributions: no near-ties for greedy decoding
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


def hf_tokenizer_dir(root: Path, config: dict) -> Path:
    """A Hugging Face tokenizer directory (a byte-level BPE trained on a line, end-of-text <|endoftext|>) with
    `config` in its tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", **config}))
    return root


def hf_gpt2_dir(directory: Path, text: str, block_size: int = 64, vocab_size: int = 400) -> Path:
    """A random GPT-2 (n_layer 2, n_embd 64) saved by transformers' save_pretrained, its Conv1D weights stored
    (in, out), with a byte-level BPE trained on `text` (end-of-text <|endoftext|>): no GPT-2 files needed."""
    import json

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i : i + 5000] for i in range(0, len(text), 5000)], trainer)
    eos = tok.token_to_id("<|endoftext|>")
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                  "eos_token": "<|endoftext|>"}))
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=4,
                                  n_positions=block_size, bos_token_id=eos, eos_token_id=eos, initializer_range=0.3)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(directory)
    return directory


# --- llama.cpp (llama-cpp-python, the `bench` extra) ------------------------------------------------------------
def open_llama_cpp(gguf_path: Path, **options: object):  # noqa: ANN201 - llama_cpp.Llama, an optional package
    """llama.cpp over a GGUF file (one thread, a 64-token context; `options` go to `llama_cpp.Llama`); skips the
    test where llama-cpp-python is not installed."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the `bench` extra)")
    return llama_cpp.Llama(str(gguf_path), n_ctx=64, verbose=False, n_threads=1, **options)


def llama_cpp_greedy(llm: object, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's first `n` greedy tokens after `prompt`."""
    tokens: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # type: ignore[attr-defined]
        tokens.append(token)
        if len(tokens) == n:
            break
    return tokens


# --- decode steps -------------------------------------------------------------------------------------------------
def within_step_rounding(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, fp32_tol: float = 1e-5) -> bool:
    """Whether two decode steps' outputs agree within the C++ step's rounding of the lean one's (its fp32 sums in
    another order; a bf16 model's odd bf16 rounding), relative to the largest value."""
    tol = 2**-7 if dtype == torch.bfloat16 else fp32_tol
    return bool((a.float() - b.float()).abs().max() <= tol * a.float().abs().max())


def decode_rows_beside(model, held: dict[int, int], fed: dict[int, int], seqs: dict[int, list[int]],  # noqa: ANN001
                       max_len: int = 24):  # noqa: ANN201
    """One C++ step call (`decode_rows`) that feeds cache row r its tokens seqs[r][held[r] : held[r] + fed[r]]
    after prefilling the held[r] before them: (the cache, the hidden states (rows, C) in the order fed). Under
    the model's packed Linears."""
    from gptlab.generation import native_decode
    from gptlab.generation.fast_decode import decode_rows
    from gptlab.generation.packed_linear import PackedLinears
    from gptlab.generation.prefill import prefill_rows
    from gptlab.kv_cache import KVCache

    cache = KVCache(model.config, max(held) + 1, max_len, dtype=native_decode.cache_dtype(model),
                    attend_dtype=torch.float32)
    with torch.inference_mode(), PackedLinears(model).active():
        for r, n in held.items():
            if n:
                prefill_rows(model, cache, [r], [seqs[r][:n]])
        weights = native_decode.weights(model, cache)
        assert weights is not None  # the C++ step runs
        rows = [(r, held[r] + i, seqs[r][held[r] + i]) for r in fed for i in range(fed[r])]
        return cache, decode_rows(model, cache, *(list(col) for col in zip(*rows, strict=True)), weights)
