"""Helpers the tests share: where the offline data lives, tiny models and tokenizers, small data sets and recipes,
and the check that a command failed with one clean line. Import them as `from helpers import ...`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gptlab import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"  # shared/data beside the repository (CI clones it there too)
TINY_SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
GPT2_FILES = SHARED_DATA / "gpt2"  # encoder.json + vocab.bpe: OpenAI's original GPT-2 BPE files
TIKTOKEN_CACHE = SHARED_DATA / "tiktoken_cache"


# --- command-line results ---------------------------------------------------------------------------------------
def one_line_error(rc: int, err: str, notes: int = 0) -> str:
    """The CLI's exit code 2 and a single `error:` line (after `notes` progress lines), no traceback."""
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == notes + 1 and lines[-1].startswith("error: "), err
    return lines[-1]


# --- models and tokenizers ----------------------------------------------------------------------------------------
def tiny_model(
    position: str = "rope", block_size: int = 64, vocab_size: int = 256, seed: int = 0, **kw
) -> GPT:
    """A few-thousand-parameter random model; larger init so its greedy choices are not all the same token."""
    torch.manual_seed(seed)
    cfg = GPTConfig.preset(
        "tiny", position=position, block_size=block_size, vocab_size=vocab_size, init_std=0.3, **kw
    )
    return GPT(cfg).eval()


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

    def decode(self, ids) -> str:  # noqa: ANN001
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


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
    """A char-level DATA_DIR made from the start of tiny Shakespeare (90% train / 10% val)."""
    from gptlab.data import prepare

    text = root / "text.txt"
    text.write_text(TINY_SHAKESPEARE.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    out = root / "data"
    prepare([text], out, tokenizer="char")
    return out


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
