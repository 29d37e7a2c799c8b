"""Attention weights of a prompt, per layer and head, with the prompt's tokens to label them.

Read through the hook points (`blocks.{i}.attn.hook_pattern`, `gptlab.hooks.run_with_cache`): a layer whose
pattern is hooked runs the manual attention path, whose softmax weights (B, nh, T, T) the hook sees. Grouped-query
models repeat each key/value head over its query heads there, so there is one map per query head whatever the
family. Each row (a query) sums to 1 over the keys it may see, and is 0 above the diagonal (causal) and outside a
sliding window.

`encode_prompt` turns text into token ids with one-line errors (empty, too long for the context), which the CLI
and the server's page share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gptlab.errors import GptlabError
from gptlab.hooks import run_with_cache
from gptlab.model import GPT
from gptlab.tokenizer.base import UnknownCharacters, token_text

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer


def encode_prompt(tokenizer: TextTokenizer, text: str, max_tokens: int) -> list[int]:
    """The prompt's token ids, checked to be 1..max_tokens long (the model's context, or a server's bound)."""
    if not text:
        raise GptlabError("the prompt is empty: pass some text to look at")
    try:
        ids = tokenizer.encode(text)
    except UnknownCharacters as e:  # its own message advises prepare's --tokenizer, which a trained model cannot take
        raise GptlabError(e.of("the prompt")) from None
    if not ids:
        raise GptlabError("the prompt encodes to no tokens: pass some text to look at")
    if len(ids) > max_tokens:
        raise GptlabError(f"the prompt is {len(ids)} tokens; at most {max_tokens} fit (the model's context or the "
                          "limit here): shorten it")
    return ids


def token_labels(tokenizer: TextTokenizer, ids: list[int]) -> list[str]:
    """Each token as its own text (a byte-level token that is part of a character shows as U+FFFD)."""
    return [token_text(tokenizer, i) for i in ids]


def check_index(kind: str, value: int | None, count: int) -> None:
    """A layer or head number in 0..count-1 (None: all of them), else a one-line error naming the range."""
    if value is not None and not 0 <= value < count:
        raise GptlabError(f"--{kind} {value} is out of range: this model has {kind}s 0..{count - 1}")


@dataclass
class AttentionMap:
    """The weights of one prompt: `weights` (n_layer, n_head, T, T), float32 on the CPU, row t = query t."""

    tokens: list[str]
    token_ids: list[int]
    weights: torch.Tensor

    @property
    def n_layer(self) -> int:
        return self.weights.shape[0]

    @property
    def n_head(self) -> int:
        return self.weights.shape[1]

    def select(self, layer: int | None, head: int | None) -> torch.Tensor:
        """(T, T) for a layer and head; a head's or the heads' average over layers: (n_layer, T, T) when layer is
        None; all heads (n_head, T, T) when head is None. Both None: each layer's head-average."""
        check_index("layer", layer, self.n_layer)
        check_index("head", head, self.n_head)
        w = self.weights if layer is None else self.weights[layer]
        if head is None:
            return w.mean(dim=-3) if layer is None else w
        return w[..., head, :, :]

    def to_json(self, layer: int | None = None, head: int | None = None, digits: int = 6) -> dict[str, Any]:
        """{"tokens", "token_ids", "n_layer", "n_head", "layers": [{"layer", "heads": [{"head", "weights"}]}]},
        for the chosen layer / head or all of them; weights rounded to `digits` decimals."""
        check_index("layer", layer, self.n_layer)
        check_index("head", head, self.n_head)
        layers = range(self.n_layer) if layer is None else [layer]
        heads = range(self.n_head) if head is None else [head]
        return {
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "layers": [
                {"layer": i, "heads": [{"head": h, "weights": _rounded(self.weights[i, h], digits)} for h in heads]}
                for i in layers
            ],
        }


def _rounded(w: torch.Tensor, digits: int) -> list[list[float]]:
    return [[round(x, digits) for x in row] for row in w.tolist()]


@torch.no_grad()
def attention_map(model: GPT, tokenizer: TextTokenizer, text: str, max_tokens: int | None = None) -> AttentionMap:
    """The attention weights of `text` (at most `max_tokens` tokens, default the model's context)."""
    ids = encode_prompt(tokenizer, text, max_tokens or model.config.block_size)
    device = next(model.parameters()).device
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(model.config.n_layer)]
    _, cache = run_with_cache(model, torch.tensor([ids], device=device), names, device="cpu", dtype=torch.float32)
    weights = torch.stack([cache[name][0] for name in names])  # (n_layer, nh, T, T)
    return AttentionMap(token_labels(tokenizer, ids), ids, weights)
