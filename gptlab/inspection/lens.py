"""The logit lens: what the model would predict if it stopped after each layer.

The residual stream after the embeddings and after each block goes through the model's own final norm and LM
head (`GPT.logits`, soft-cap included), as if it were the last layer's. Read down a position's column: early
layers guess poorly (often the current token itself, or common ones), later ones converge on the answer. The
last layer's guesses are the model's: final norm + head over the last block's output is what `GPT.forward`
computes (a post-norm model's last block ends in its own norm; its final norm is the identity).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gptlab.hooks import run_with_cache
from gptlab.inspection.attention import encode_prompt, token_labels
from gptlab.model import GPT

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer


@dataclass
class LensResult:
    """The k likeliest next tokens of each stage (after the embeddings, then after each block) and position:
    `probs` and `ids` (n_layer + 1, T, k)."""

    tokens: list[str]
    token_ids: list[int]
    probs: torch.Tensor
    ids: torch.Tensor

    @property
    def layers(self) -> list[str]:
        return ["embeddings"] + [f"layer {i}" for i in range(self.probs.shape[0] - 1)]

    def top(self, tokenizer: TextTokenizer) -> list[list[list[tuple[str, float]]]]:
        """[stage][position] -> the k guesses as (text, probability)."""
        unique = self.ids.unique().tolist()
        labels = dict(zip(unique, token_labels(tokenizer, unique), strict=True))
        return [[[(labels[i], p) for i, p in zip(pos_ids, pos_p, strict=True)]
                 for pos_ids, pos_p in zip(stage_ids, stage_p, strict=True)]
                for stage_ids, stage_p in zip(self.ids.tolist(), self.probs.tolist(), strict=True)]

    def to_json(self, tokenizer: TextTokenizer) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "layers": self.layers,
            "top": [[[{"token": t, "prob": round(p, 6)} for t, p in pos] for pos in stage]
                    for stage in self.top(tokenizer)],
        }


@torch.no_grad()
def stage_logits(model: GPT, ids: list[int]) -> Iterator[torch.Tensor]:
    """The lens's logits (T, V), float32, one stage at a time (all at once would be n_layer x T x V floats)."""
    # the residual stream as it enters the first block, and as each block hands it on
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(model.config.n_layer)]
    _, streams = run_with_cache(model, ids, names)
    for name in names:
        yield model.logits(model.transformer.ln_f(streams[name]))[0].float()


def logit_lens(
    model: GPT, tokenizer: TextTokenizer, text: str, k: int = 3, max_tokens: int | None = None
) -> LensResult:
    """The lens over `text` (at most `max_tokens` tokens, default the model's context): k guesses per stage."""
    ids = encode_prompt(tokenizer, text, max_tokens or model.config.block_size)
    k = min(k, model.config.vocab_size)
    tops = [logits.softmax(dim=-1).topk(k, dim=-1) for logits in stage_logits(model, ids)]
    probs = torch.stack([t.values.cpu() for t in tops])
    return LensResult(token_labels(tokenizer, ids), ids, probs, torch.stack([t.indices.cpu() for t in tops]))


def format_lens(result: LensResult, tokenizer: TextTokenizer) -> str:
    """Per position: the token there, then each stage's guesses with their probabilities."""
    top = result.top(tokenizer)
    width = max(len(name) for name in result.layers)
    lines = []
    for t, token in enumerate(result.tokens):
        lines.append(f"position {t}: {token!r} ->")
        for name, stage in zip(result.layers, top, strict=True):
            guesses = "  ".join(f"{text!r} {p:.2f}" for text, p in stage[t])
            lines.append(f"  {name:<{width}}  {guesses}")
    return "\n".join(lines)
