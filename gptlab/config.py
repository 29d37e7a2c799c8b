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

from gptlab.checked import InvalidField, bounded, check_fields
from gptlab.fileio import atomic_write_json, read_json_object

NormKind = Literal["layernorm", "rmsnorm"]
PositionKind = Literal["learned", "rope", "none"]
MLPKind = Literal["gelu", "swiglu", "geglu", "relu2"]
BlockKind = Literal["pre", "post", "parallel", "sandwich"]
AttentionKind = Literal["sdpa", "manual"]
GeluApproximate = Literal["tanh", "none"]
RopeScalingKind = Literal["linear", "dynamic", "yarn", "llama3", "longrope"]


@dataclass
class RopeScaling:
    """How RoPE's frequencies are stretched past the context a model was trained on (`rope_scaling` in Hugging
    Face configs). The maths of each kind is in `gptlab.rope`; only the fields a kind uses may be set.

    linear: positions divided by `factor`. dynamic: NTK-aware base that grows once a forward's last position passes
    `original_context`. yarn: per-frequency blend of interpolation and extrapolation (`beta_fast`, `beta_slow`) plus
    `attention_factor` on cos/sin. llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp
    between (`low_freq_factor`, `high_freq_factor`). longrope (Phi-3's "su"): per-frequency `short_factor`, or
    `long_factor` once a forward's last position passes `original_context`, plus `attention_factor`.
    """

    kind: RopeScalingKind
    factor: float = 1.0
    original_context: int | None = None  # the context the model was pretrained on
    attention_factor: float | None = None  # yarn, longrope: cos and sin are multiplied by it (None: the paper's rule)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    short_factor: tuple[float, ...] | None = None  # longrope, one per rotary frequency
    long_factor: tuple[float, ...] | None = None

    _USES: typing.ClassVar[dict[str, tuple[str, ...]]] = {
        "linear": ("factor",),
        "dynamic": ("factor", "original_context"),
        "yarn": ("factor", "original_context", "attention_factor", "beta_fast", "beta_slow", "truncate"),
        "llama3": ("factor", "original_context", "low_freq_factor", "high_freq_factor"),
        "longrope": ("original_context", "attention_factor", "short_factor", "long_factor"),
    }

    def __post_init__(self) -> None:
        for key in ("short_factor", "long_factor"):  # JSON gives lists
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or not all(_is_number(v) and v > 0 for v in value):
                raise ValueError(f"rope_scaling.{key} must be a list of positive numbers, got {value!r}")
            setattr(self, key, tuple(float(v) for v in value))
        for key in ("factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor", "attention_factor"):
            value = getattr(self, key)
            if not (_is_number(value) or (key == "attention_factor" and value is None)):
                raise ValueError(f"rope_scaling.{key} must be a number, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate must be true or false, got {self.truncate!r}")
        if self.kind not in self._USES:
            raise ValueError(f"rope_scaling.kind={self.kind!r} is not one of {', '.join(self._USES)}")
        uses = self._USES[self.kind]
        for f in dataclasses.fields(self):
            if f.name != "kind" and f.name not in uses and getattr(self, f.name) != f.default:
                raise ValueError(f"rope_scaling.{f.name} does not apply to {self.kind} scaling")
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be a number >= 1, got {self.factor!r}")
        if "original_context" in uses and (not isinstance(self.original_context, int) or self.original_context < 2):
            raise ValueError(f"rope_scaling.original_context must be an integer >= 2 for {self.kind} scaling, "
                             f"got {self.original_context!r}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"rope_scaling.attention_factor must be positive, got {self.attention_factor}")
        if self.kind == "yarn" and not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError("rope_scaling needs 0 < beta_slow <= beta_fast")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("rope_scaling needs 0 < low_freq_factor < high_freq_factor")
        if self.kind == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope rope_scaling needs short_factor and long_factor")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeScaling:
        check_known_fields(cls, d, "rope_scaling")
        if "kind" not in d:
            raise ValueError(f"rope_scaling needs a kind: one of {', '.join(cls._USES)}")
        return cls(**d)


def check_known_fields(cls: type, d: dict[str, Any], what: str) -> None:
    """ValueError naming the keys of `d` that are not fields of the dataclass `cls`."""
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown {what} field(s): {', '.join(unknown)}")


MAX_DIMENSION = 2**31 - 1  # a width, a vocabulary, a context: products of two must fit torch's int64 sizes
MAX_LAYERS = 65_536


def _is_number(value: object) -> bool:
    """A finite int or float: nan and inf pass no comparison (so no range check) and poison every weight."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class GPTConfig:
    # --- sizes ---
    vocab_size: int = bounded(50257, int, low=1, high=MAX_DIMENSION)
    # context length: the longest sequence the model accepts
    block_size: int = bounded(1024, int, low=1, high=MAX_DIMENSION)
    n_layer: int = bounded(12, int, low=1, high=MAX_LAYERS)  # each a module built in turn
    n_head: int = bounded(12, int, low=1, high=MAX_DIMENSION)
    # key/value heads: 1 = multi-query, n_head = multi-head (default), else grouped
    n_kv_head: int | None = bounded(None, int, low=1, high=MAX_DIMENSION, optional=True)
    n_embd: int = bounded(768, int, low=1, high=MAX_DIMENSION)
    # width of each head when it is not n_embd / n_head (Gemma, Qwen3)
    head_dim: int | None = bounded(None, int, low=1, high=MAX_DIMENSION, optional=True)
    # --- normalization ---
    norm: NormKind = "layernorm"
    norm_eps: float = bounded(1e-5, low=0, low_open=True)
    norm_weight: bool = True  # norms have a learned scale (and LayerNorm's bias); False: parameter-free norms
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), the weight starting at 0 (Gemma)
    embedding_norm: bool = False  # normalize the token embeddings before the first block
    scale_embeddings: bool = False  # multiply the token embeddings by sqrt(n_embd) (Gemma)
    # move the token embeddings and each MLP's input toward the previous position's, by a learned share per channel
    # (`gptlab.token_shift`)
    token_shift: bool = False
    # --- biases: `bias` sets every Linear's and LayerNorm's; the fields after it override one part (None: as bias)
    bias: bool = True  # biases in every Linear and LayerNorm (GPT-2, NeoX) or none (Llama)
    qkv_bias: bool | None = None  # on the q, k, v projection (Qwen2: True with bias False)
    attn_proj_bias: bool | None = None  # on the attention's output projection (GPT-J: False)
    norm_bias: bool | None = None  # on LayerNorms (a LayerNorm-bias-only model: True with bias False)
    head_bias: bool = False  # on the LM head (GPT-J)
    # --- positions ---
    position: PositionKind = "learned"
    rope_base: float = bounded(10000.0, low=0, low_open=True)
    # share of each head's dims that RoPE rotates (0.25 for GPT-NeoX / Pythia)
    rotary_fraction: float = bounded(1.0, low=0, high=1, low_open=True)
    rope_interleaved: bool = False  # rotate pairs of adjacent dims (GPT-J) instead of the two halves (Llama, NeoX)
    rope_scaling: RopeScaling | None = None  # stretched frequencies for long contexts (see RopeScaling)
    # --- feed-forward ---
    mlp: MLPKind = "gelu"
    gelu_approximate: GeluApproximate = "tanh"  # GPT-2 uses the tanh approximation; NeoX the exact GELU
    # explicit hidden size; else mlp_ratio * n_embd rounded up to mlp_multiple
    mlp_hidden: int | None = bounded(None, int, low=1, high=MAX_DIMENSION, optional=True)
    mlp_ratio: float = bounded(4.0, low=0, low_open=True)
    mlp_multiple: int = bounded(1, int, low=1, high=MAX_DIMENSION)
    # --- block layout ---
    # pre-norm (GPT-2), post-norm (original transformer), parallel (GPT-J / NeoX), sandwich: norms before and after
    # each of attention and MLP (Gemma 2)
    block: BlockKind = "pre"
    shared_norm: bool = False  # a parallel block's attention and MLP read one norm of x (GPT-J), not one each
    # --- attention ---
    qk_norm: bool = False  # RMS-normalize q and k per head before attention
    qk_norm_weight: bool = False  # ... with a learned scale per head dim (Qwen3)
    # attention scores' scale; None: 1 / sqrt(head size)
    attn_scale: float | None = bounded(None, low=0, low_open=True, optional=True)
    # scores = cap * tanh(scores / cap) before the mask (Gemma 2)
    attn_softcap: float | None = bounded(None, low=0, low_open=True, optional=True)
    # a query sees only the last `sliding_window` positions, itself included
    sliding_window: int | None = bounded(None, int, low=1, high=MAX_DIMENSION, optional=True)
    # with sliding_window: layers k-1, 2k-1, ... see everything (Gemma 2: 2)
    global_layer_every: int | None = bounded(None, int, low=2, high=MAX_LAYERS, optional=True)
    # --- head and training ---
    tie_embeddings: bool = True  # the LM head shares the token-embedding matrix
    # on embeddings, attention weights and residual branches
    dropout: float = bounded(0.0, low=0, high=1, high_open=True)
    # logits = cap * tanh(logits / cap) when set
    logit_softcap: float | None = bounded(None, low=0, low_open=True, optional=True)
    attention: AttentionKind = "sdpa"  # fused scaled_dot_product_attention, or the readable manual path
    init_std: float = bounded(0.02, low=0)
    scale_residual_init: bool = True  # GPT-2's init: residual projections' std divided by sqrt(2 * n_layer)
    name: str = field(default="custom", compare=False)
    # the Hugging Face architecture this model came from (or is meant for): export prefers it when it fits
    hf_architecture: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling.from_dict(self.rope_scaling)
        elif not isinstance(self.rope_scaling, (RopeScaling, type(None))):
            raise ValueError(f"rope_scaling must be an object with a kind, or null; got {self.rope_scaling!r}")
        # one spelling per model: an override equal to what it overrides is stored as None
        for key in ("qkv_bias", "attn_proj_bias", "norm_bias"):
            if getattr(self, key) is self.bias:  # "is": only a bool equal to it, not 1 or 0
                setattr(self, key, None)
        if (self.head_dim is not None and isinstance(self.n_head, int) and self.n_head > 0
                and self.head_dim * self.n_head == self.n_embd):
            self.head_dim = None
        self.validate()

    # ------------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent setting."""
        for key, choices in choices_of(type(self)).items():
            if getattr(self, key) not in choices:
                raise ValueError(f"{key}={getattr(self, key)!r} is not one of {', '.join(choices)}")
        # a switch read from JSON as "false" is truthy: it would build the other model without a word
        for key, optional in switches_of(type(self)).items():
            value = getattr(self, key)
            if not (isinstance(value, bool) or (optional and value is None)):
                raise InvalidField(key, value, "must be true or false" + (" (or null)" if optional else ""))
        check_fields(self)  # each number's range, written beside its field
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head} (set head_dim for "
                             "heads of another width)")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.position == "rope" and self.rotary_dim < 2:
            raise ValueError(f"rotary_fraction={self.rotary_fraction} leaves fewer than 2 rotary dims per head")
        if self.mlp_hidden is None and not _is_number(self.mlp_ratio * self.n_embd):
            raise ValueError(f"mlp_ratio={self.mlp_ratio} x n_embd={self.n_embd} is too large a hidden size")
        if self.hidden_size < 1:  # a tiny ratio rounds down to no hidden layer at all
            raise ValueError(f"mlp_ratio={self.mlp_ratio} leaves the MLP no hidden units at n_embd={self.n_embd}")
        self._validate_combinations()

    def _validate_combinations(self) -> None:
        """Switches that only mean something together with another."""
        needs = [  # (set, what it needs, why)
            (self.norm_unit_offset, self.norm == "rmsnorm" and self.norm_weight, "norm=rmsnorm with norm_weight"),
            (self.norm_bias, self.norm == "layernorm" and self.norm_weight, "norm=layernorm with norm_weight"),
            (self.shared_norm, self.block == "parallel", "block=parallel"),
            (self.qk_norm_weight, self.qk_norm, "qk_norm"),
            (self.rope_interleaved, self.position == "rope", "position=rope"),
            (self.rope_scaling is not None, self.position == "rope", "position=rope"),
            (self.global_layer_every is not None, self.sliding_window is not None, "sliding_window"),
        ]
        names = ["norm_unit_offset", "norm_bias", "shared_norm", "qk_norm_weight", "rope_interleaved",
                 "rope_scaling", "global_layer_every"]
        for name, (is_set, ok, need) in zip(names, needs, strict=True):
            if is_set and not ok:
                raise ValueError(f"{name} needs {need}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.kind == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(getattr(scaling, key)) != self.rotary_dim // 2:
                    raise ValueError(f"rope_scaling.{key} has {len(getattr(scaling, key))} values; the model "
                                     f"rotates {self.rotary_dim // 2} frequencies per head")

    # --- derived sizes ----------------------------------------------------------------------------------------
    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    def has_bias(self, part: Literal["qkv", "attn_proj", "mlp", "norm", "head"]) -> bool:
        """Whether one part of the model has biases: `bias` unless that part's override says otherwise."""
        if part == "head":
            return self.head_bias
        override = None if part == "mlp" else getattr(self, f"{part}_bias")
        return self.bias if override is None else override

    @property
    def gated_mlp(self) -> bool:
        """The MLP's first matmul gives a gate and an up projection (SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    def sliding_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.global_layer_every is None or (layer + 1) % self.global_layer_every != 0

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
        if not isinstance(d, dict):  # a list failed inside the unknown-field check: "sequence item 0: expected str"
            raise ValueError(f"a GPTConfig is read from a dict of its fields, got {type(d).__name__}")
        check_known_fields(cls, d, "GPTConfig")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with `changes`. An n_kv_head equal to n_head (every head its own keys and values, the default)
        follows a new n_head, as in a config built with it, rather than making the model grouped-query."""
        if "n_head" in changes and "n_kv_head" not in changes and self.n_kv_head == self.n_head:
            changes["n_kv_head"] = None
        return dataclasses.replace(self, **changes)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> GPTConfig:
        return cls.from_dict(read_json_object(path))

    def describe(self) -> str:
        """One line naming the architecture's switches (`gptlab info`)."""
        kv = "" if self.n_kv_head == self.n_head else f", {self.n_kv_head} kv heads"
        blocks = {"pre": "pre-norm", "post": "post-norm", "parallel": "parallel", "sandwich": "sandwich-norm"}[
            self.block]
        head = "" if self.head_dim is None else f" of width {self.head_dim}"
        window = ""
        if self.sliding_window is not None:
            every = "" if self.global_layer_every is None else f", every {self.global_layer_every} layers one global"
            window = f", sliding window {self.sliding_window}{every}"
        scaling = "" if self.rope_scaling is None else f" ({self.rope_scaling.kind} scaling)"
        extras = [text for on, text in [
            (not self.norm_weight, "parameter-free norms"), (self.norm_unit_offset, "(1 + w) norms"),
            (self.embedding_norm, "normalized embeddings"), (self.scale_embeddings, "scaled embeddings"),
            (self.token_shift, "token shift"),
            (self.rope_interleaved, "interleaved rope"), (self.shared_norm, "one norm per block"),
            (self.qk_norm, "qk-norm"), (self.attn_softcap is not None, "attention soft-cap"),
            (self.logit_softcap is not None, "logit soft-cap"),
        ] if on]
        body = ["qkv", "attn_proj", "mlp"] + (["norm"] if self.norm == "layernorm" else [])
        biased = [part for part in [*body, "head"] if self.has_bias(part)]
        bias = "with bias" if biased == body else "no bias" if not biased else f"biases on {', '.join(biased)}"
        return (f"{self.n_layer} layers, {self.n_head} heads{head}{kv}, width {self.n_embd}, context "
                f"{self.block_size}, vocab {self.vocab_size}; {self.norm}, {self.position} positions{scaling}, "
                f"{self.mlp} mlp (hidden {self.hidden_size}), {blocks} blocks{window}, "
                f"{'tied' if self.tie_embeddings else 'untied'} head, {bias}"
                + "".join(f", {e}" for e in extras))


@functools.cache
def choices_of(cls: type) -> dict[str, tuple[Any, ...]]:
    """The allowed values of every Literal-typed field of a dataclass, read from its type hints: the one place
    choices are written is the type itself."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


@functools.cache
def switches_of(cls: type) -> dict[str, bool]:
    """The bool-typed fields of a dataclass, each with whether it may also be None, read from its type hints."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] is not bool for f in dataclasses.fields(cls)
            if hints[f.name] in (bool, bool | None)}
