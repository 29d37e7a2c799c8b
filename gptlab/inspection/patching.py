"""Activation patching and ablation over gptlab's hook points (`gptlab.hooks`).

Patching asks which activations carry the difference between two prompts of the same length: the corrupted
prompt runs with one site's activation taken from the clean run, and a metric of the logits (e.g. the logit
difference between the clean answer and the corrupted one) is read, per site. A site is a layer, optionally a
position and a head. Ablation removes heads (their output before the output projection, `attn.hook_z`) or MLP
neurons (`mlp.hook_post`): set to zero, or to their mean over reference text.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from gptlab.errors import GptlabError
from gptlab.hooks import HookFn, as_batch, check_names, hook_point_names, run_with_cache, run_with_hooks
from gptlab.inspection.attention import encode_prompt, token_labels
from gptlab.model import GPT
from gptlab.tokenizer.base import token_text

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

Metric = Callable[[torch.Tensor], "torch.Tensor | float"]  # logits (B, T, vocab) -> a number
AblationKind = Literal["zero", "mean"]

HEAD_AXIS = {"attn.hook_q": 2, "attn.hook_k": 2, "attn.hook_v": 2, "attn.hook_rot_q": 2, "attn.hook_rot_k": 2,
             "attn.hook_z": 2, "attn.hook_pattern": 1, "attn.hook_attn_scores": 1}
POSITION_AXIS = {"attn.hook_pattern": 2, "attn.hook_attn_scores": 2}  # the query's; every other point: axis 1


def logit_difference(answer: int, wrong: int, position: int = -1) -> Metric:
    """The metric logits[:, position, answer] - logits[:, position, wrong], averaged over the batch."""
    def metric(logits: torch.Tensor) -> torch.Tensor:
        # named here: else an IndexError from inside the patching loop, or for a negative token id a logit
        # counted from the vocabulary's end without a word
        vocab, length = logits.shape[-1], logits.shape[1]
        for what, token in (("answer", answer), ("wrong", wrong)):
            if not 0 <= token < vocab:
                raise GptlabError(f"logit_difference's {what} token {token} is outside the vocabulary [0, {vocab})")
        if not -length <= position < length:
            raise GptlabError(f"logit_difference's position {position} is outside the prompt's {length} tokens")
        return (logits[:, position, answer] - logits[:, position, wrong]).mean()
    return metric


def _pair(model: GPT, clean: Any, corrupt: Any) -> tuple[torch.Tensor, torch.Tensor]:
    clean, corrupt = as_batch(model, clean), as_batch(model, corrupt)
    if clean.shape != corrupt.shape:
        raise GptlabError(f"the clean and corrupted prompts must be the same length to patch one into the other: "
                          f"{clean.shape[-1]} and {corrupt.shape[-1]} tokens")
    return clean, corrupt


@torch.no_grad()
def activation_patching(
    model: GPT,
    clean: torch.Tensor | Sequence[int],
    corrupt: torch.Tensor | Sequence[int],
    metric: Metric,
    point: str = "hook_resid_pre",
    positions: bool = True,
    heads: bool | None = None,
) -> torch.Tensor:
    """The metric of the corrupted run with `point` (a layer's hook point without its `blocks.{i}.`, e.g.
    `hook_resid_pre`, `attn.hook_z`, `mlp.hook_post`) patched from the clean run, at each site: a tensor
    (n_layer, [T], [heads]), with a position axis when `positions` and a head axis when `heads` (default: when
    the point has heads). One forward per site."""
    clean, corrupt = _pair(model, clean, corrupt)
    names = check_names(model, [f"blocks.{i}.{point}" for i in range(model.config.n_layer)])
    if heads and point not in HEAD_AXIS:
        raise GptlabError(f"{point} has no head axis: patch it per layer and position")
    heads = point in HEAD_AXIS if heads is None else heads
    _, cache = run_with_cache(model, clean, names)
    axes = ([POSITION_AXIS.get(point, 1)] if positions else []) + ([HEAD_AXIS[point]] if heads else [])
    sizes = [cache[names[0]].shape[a] for a in axes]
    result = torch.empty(len(names), *sizes)
    for layer, name in enumerate(names):
        for site in itertools.product(*map(range, sizes)):
            index = [slice(None)] * cache[name].dim()
            for axis, i in zip(axes, site, strict=True):
                index[axis] = i
            fn = _patch(cache[name], tuple(index))
            result[(layer, *site)] = float(metric(run_with_hooks(model, corrupt, {name: fn})))
    return result


def _patch(source: torch.Tensor, index: tuple) -> HookFn:
    def patch(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[index] = source[index]
        return x
    return patch


def _set(index: int, value: torch.Tensor | float, axis: int) -> HookFn:
    """A hook setting slice `index` of `axis` (negative: from the end) to `value`."""
    def ablate(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.select(axis, index).copy_(torch.as_tensor(value, dtype=x.dtype).expand_as(x.select(axis, index)))
        return x
    return ablate


def _chain(fns: list[HookFn]) -> HookFn:
    def run(x: torch.Tensor) -> torch.Tensor:
        for fn in fns:
            x = fn(x)
        return x
    return run


def _check_site(kind: str, layer: int, index: int, n_layer: int, count: int) -> None:
    if not (0 <= layer < n_layer and 0 <= index < count):
        raise GptlabError(f"{kind} ({layer}, {index}) is out of range: this model has layers 0..{n_layer - 1} and "
                          f"{kind}s 0..{count - 1}")


def ablation_hooks(
    model: GPT,
    heads: Iterable[tuple[int, int]] = (),
    neurons: Iterable[tuple[int, int]] = (),
    kind: AblationKind = "zero",
    reference: torch.Tensor | Sequence[int] | None = None,
) -> dict[str, HookFn]:
    """Hooks (for `run_with_hooks`) that ablate (layer, head) outputs before the output projection and
    (layer, neuron) MLP activations: to zero, or (kind "mean") to their mean over the batch and positions of
    `reference` token ids."""
    if kind not in ("zero", "mean"):
        raise GptlabError(f"ablation kind must be 'zero' or 'mean', got {kind!r}")
    cfg = model.config
    sites = [Site("head", "attn.hook_z", layer, head, 2) for layer, head in heads]
    sites += [Site("neuron", "mlp.hook_post", layer, n, -1) for layer, n in neurons]
    for s in sites:
        _check_site(s.kind, s.layer, s.index, cfg.n_layer, cfg.n_head if s.kind == "head" else cfg.hidden_size)
    means: dict[str, torch.Tensor] = {}
    if kind == "mean":
        if reference is None:
            raise GptlabError("mean ablation needs reference token ids to average the activations over")
        _, means = run_with_cache(model, reference, {s.name for s in sites})
    fns: dict[str, list[HookFn]] = {}
    for s in sites:
        value = 0.0 if kind == "zero" else means[s.name].select(s.axis, s.index).flatten(0, 1).mean(0)
        fns.setdefault(s.name, []).append(_set(s.index, value, s.axis))
    return {name: _chain(chain) for name, chain in fns.items()}


@dataclass(frozen=True)
class Site:
    kind: str  # "head" or "neuron"
    point: str
    layer: int
    index: int
    axis: int

    @property
    def name(self) -> str:
        return f"blocks.{self.layer}.{self.point}"


def ablate(
    model: GPT,
    idx: torch.Tensor | Sequence[int],
    heads: Iterable[tuple[int, int]] = (),
    neurons: Iterable[tuple[int, int]] = (),
    kind: AblationKind = "zero",
    reference: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """The logits of `idx` with the heads and neurons ablated (see `ablation_hooks`)."""
    return run_with_hooks(model, idx, ablation_hooks(model, heads, neurons, kind, reference))


# --- two prompts as text: what `gptlab patch` and the web page show -------------------------------------------------
# what the CLI's --point and the page's "point" name, short for the layer's hook point patched
PATCH_POINTS = {"resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
                "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out", "z": "attn.hook_z"}


@dataclass
class PatchingMap:
    """The metric (logit of `answer` minus that of `wrong` at the last position) of the corrupted prompt with
    `point` patched from the clean one: `values` (n_layer, T) per layer and position, or (n_layer, n_head) for
    heads (`attn.hook_z` over all positions); `clean` and `corrupt`: the metric of each prompt unpatched."""

    tokens: list[str]
    point: str
    values: torch.Tensor
    clean: float
    corrupt: float
    answer: str
    wrong: str

    def to_json(self, digits: int = 6) -> dict[str, Any]:
        return {"tokens": self.tokens, "point": self.point, "answer": self.answer, "wrong": self.wrong,
                "clean": round(self.clean, digits), "corrupt": round(self.corrupt, digits),
                "axes": ["layer", "head" if self.point == "attn.hook_z" else "position"],
                "values": [[round(v, digits) for v in row] for row in self.values.tolist()]}


def _points(model: GPT) -> list[str]:
    """The PATCH_POINTS names this model has."""
    names = set(hook_point_names(model))
    return [short for short, point in PATCH_POINTS.items() if f"blocks.0.{point}" in names]


def single_token(tokenizer: TextTokenizer, text: str, flag: str) -> int:
    """The one token `text` encodes to (after any start token the tokenizer always adds), else a one-line error."""
    start = len(tokenizer.encode(""))
    try:
        ids = tokenizer.encode(text)[start:]
    except GptlabError as e:  # a character the vocabulary lacks
        raise GptlabError(f"{flag}: {e}") from None
    if len(ids) != 1:
        raise GptlabError(f"{flag} {text!r} is {len(ids)} tokens: pass the text of a single token")
    return ids[0]


def _encode(tokenizer: TextTokenizer, text: str, limit: int, flag: str) -> list[int]:
    try:
        return encode_prompt(tokenizer, text, limit)
    except GptlabError as e:
        raise GptlabError(f"{flag}: {e}") from None


@torch.no_grad()
def patch_prompts(
    model: GPT, tokenizer: TextTokenizer, clean: str, corrupt: str, point: str = "resid_pre",
    answer: str | None = None, wrong: str | None = None, max_tokens: int | None = None,
) -> PatchingMap:
    """`activation_patching` of two texts (each at most `max_tokens` tokens, default the model's context) at
    `point`, a name of PATCH_POINTS. The metric's tokens default to each prompt's likeliest next token."""
    if point not in PATCH_POINTS:
        raise GptlabError(f"--point {point!r} is not one of {', '.join(PATCH_POINTS)}")
    if point not in (have := _points(model)):  # a parallel block has no resid_mid
        raise GptlabError(f"--point {point}: this model's blocks have no such point (its blocks are "
                          f"{model.config.block}); choose one of {', '.join(have)}")
    point = PATCH_POINTS[point]
    limit = max_tokens or model.config.block_size
    clean_ids = _encode(tokenizer, clean, limit, "--clean")
    corrupt_ids = _encode(tokenizer, corrupt, limit, "--corrupt")
    if len(clean_ids) != len(corrupt_ids):
        raise GptlabError(f"--corrupt is {len(corrupt_ids)} tokens and --clean {len(clean_ids)}: patching needs "
                          "prompts of the same length (change the same number of tokens)")
    clean_logits, corrupt_logits = run_with_hooks(model, clean_ids, {}), run_with_hooks(model, corrupt_ids, {})
    a = single_token(tokenizer, answer, "--answer") if answer is not None else int(clean_logits[0, -1].argmax())
    w = single_token(tokenizer, wrong, "--wrong") if wrong is not None else int(corrupt_logits[0, -1].argmax())
    if a == w:
        raise GptlabError(f"--answer and --wrong are the same token ({token_text(tokenizer, a)!r}): pass "
                          "both, different")
    metric = logit_difference(a, w)
    values = activation_patching(model, clean_ids, corrupt_ids, metric, point, positions=point != "attn.hook_z")
    return PatchingMap(token_labels(tokenizer, clean_ids), point, values, float(metric(clean_logits)),
                       float(metric(corrupt_logits)), token_text(tokenizer, a), token_text(tokenizer, w))
