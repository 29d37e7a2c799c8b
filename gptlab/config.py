"""`GPTConfig`: one dataclass with explicit switches that describes every model gptlab builds.

The GPT-2 family and the modern (Llama / NeoX style) family differ only in these switches; named presets live in
`gptlab.presets` as plain data.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gptlab.fileio import atomic_write_json, read_json_object

NormKind = Literal["layernorm", "rmsnorm"]
PositionKind = Literal["learned", "rope", "none"]
MLPKind = Literal["gelu", "swiglu", "relu2"]
BlockKind = Literal["pre", "post", "parallel"]
AttentionKind = Literal["sdpa", "manual"]
GeluApproximate = Literal["tanh", "none"]


@dataclass
class GPTConfig:
    # --- sizes ---
    vocab_size: int = 50257
    block_size: int = 1024  # context length: the longest sequence the model accepts
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # key/value heads: 1 = multi-query, n_head = multi-head (default), else grouped
    n_embd: int = 768
    # --- normalization ---
    norm: NormKind = "layernorm"
    norm_eps: float = 1e-5
    bias: bool = True  # biases in every Linear and LayerNorm (GPT-2, NeoX) or none (Llama)
    # --- positions ---
    position: PositionKind = "learned"
    rope_base: float = 10000.0
    rotary_fraction: float = 1.0  # share of each head's dims that RoPE rotates (0.25 for GPT-NeoX / Pythia)
    # --- feed-forward ---
    mlp: MLPKind = "gelu"
    gelu_approximate: GeluApproximate = "tanh"  # GPT-2 uses the tanh approximation; NeoX the exact GELU
    mlp_hidden: int | None = None  # explicit hidden size; else mlp_ratio * n_embd rounded up to mlp_multiple
    mlp_ratio: float = 4.0
    mlp_multiple: int = 1
    # --- block layout ---
    block: BlockKind = "pre"  # pre-norm (GPT-2), post-norm (original transformer), parallel (GPT-J / NeoX)
    qk_norm: bool = False  # RMS-normalize q and k per head before attention
    tie_embeddings: bool = True  # the LM head shares the token-embedding matrix
    dropout: float = 0.0  # on embeddings, attention weights and residual branches
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) when set
    attention: AttentionKind = "sdpa"  # fused scaled_dot_product_attention, or the readable manual path
    init_std: float = 0.02
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        self.validate()

    # ------------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent setting."""
        for key, choices in choices_of(type(self)).items():
            if getattr(self, key) not in choices:
                raise ValueError(f"{key}={getattr(self, key)!r} is not one of {', '.join(choices)}")
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ValueError(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction}")
        if self.position == "rope" and self.rotary_dim < 2:
            raise ValueError(f"rotary_fraction={self.rotary_fraction} leaves fewer than 2 rotary dims per head")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"mlp_hidden must be a positive integer, got {self.mlp_hidden}")

    # --- derived sizes ----------------------------------------------------------------------------------------
    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rotary_dim(self) -> int:
        """Dims per head that RoPE rotates: an even number, as HF computes it (int(head_size * fraction))."""
        dim = int(self.head_size * self.rotary_fraction)
        return dim - dim % 2

    @property
    def hidden_size(self) -> int:
        """The feed-forward hidden width (per branch for SwiGLU)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        hidden = int(self.mlp_ratio * self.n_embd)
        return self.mlp_multiple * math.ceil(hidden / self.mlp_multiple)

    # --- presets and (de)serialization ------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named preset (see `gptlab.presets`), with any field overridden: `GPTConfig.preset("gpt2", n_layer=2)`."""
        from gptlab.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        fields = {**PRESETS[name], **overrides}
        fields.setdefault("name", name)
        return cls.from_dict(fields)

    @staticmethod
    def presets() -> list[str]:
        """Names of the presets, in the order they are defined."""
        from gptlab.presets import PRESETS

        return list(PRESETS)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s): {', '.join(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> GPTConfig:
        return cls.from_dict(read_json_object(path))

    def describe(self) -> str:
        """One line naming the architecture's switches (`gptlab info`)."""
        kv = "" if self.n_kv_head == self.n_head else f", {self.n_kv_head} kv heads"
        blocks = {"pre": "pre-norm", "post": "post-norm", "parallel": "parallel"}[self.block]
        return (f"{self.n_layer} layers, {self.n_head} heads{kv}, width {self.n_embd}, context {self.block_size}, "
                f"vocab {self.vocab_size}; {self.norm}, {self.position} positions, {self.mlp} mlp "
                f"(hidden {self.hidden_size}), {blocks} blocks, "
                f"{'tied' if self.tie_embeddings else 'untied'} head, {'with' if self.bias else 'no'} bias")


@functools.cache
def choices_of(cls: type) -> dict[str, tuple[Any, ...]]:
    """The allowed values of every Literal-typed field of a dataclass, read from its type hints: the one place
    choices are written is the type itself."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}
