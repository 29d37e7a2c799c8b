"""Models and tokenizers for the generation and server tests."""

from __future__ import annotations

import torch

from gptlab import GPT, GPTConfig


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


def one_thread():  # noqa: ANN201
    """Generator for a module-scoped fixture: tiny models run fastest on one thread (no OpenMP hand-offs, and
    no spinning against other processes on a busy machine); the previous setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
