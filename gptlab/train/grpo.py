"""GRPO (Shao et al. 2024, DeepSeekMath): the policy samples its own replies and learns from verifiable rewards.

Each micro-step takes its rows' prompts (prompt/completion records prepared with `--no-pack`: one example per
window, the prompt where the loss mask is 0, the record's own reply where it is 1), samples `group_size`
completions of each through gptlab's batched engine (`generation.generate_batch`, the model in eval mode, each
row's sampler seeded from torch's RNG, which checkpoints save: a resumed run samples the same completions),
scores them with the recipe's reward function (`rewards`), and turns the scores into advantages relative to their
group: A = (r - mean of the group) / (std of the group + 1e-4), the unbiased std, as trl's GRPOTrainer.

The policy's and the reference's log-probabilities are those of the distribution the completions were sampled
from, softmax(logits / temperature), as trl's GRPOTrainer scores them (`reference.token_logps`). The loss of a
completion is trl's "grpo" loss type: per token, -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)
plus kl_beta times the k3 estimate of KL(policy || reference), exp(ref - logp) - (ref - logp) - 1, weighted by
the ratio (trl's default use_bias_correction_kl: the estimate is over the old policy's samples); averaged over
the completion's tokens, then over the step's completions. One optimizer step per batch of rollouts (trl's
num_iterations = 1), so the old policy is the current one (ratio 1 in value, its gradient the policy gradient):
the clip is there for what the formula says, and for a caller's `old_logps`. The reference, when kl_beta > 0, is
the starting weights (`reference`: with LoRA the base with its adapters off).

Completions end at the chat template's end of a reply: what it writes after one (under "plain" a newline: a
completion is one line) and its stop strings, or the end-of-text token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gptlab.data import read_meta
from gptlab.generation import SamplingParams, generate_batch
from gptlab.tokenizer import load_tokenizer
from gptlab.tokenizer.chat_template import BUILTIN_TEMPLATES, ChatTemplate, chat_template_for, reply_stops
from gptlab.train.batches import targets_of
from gptlab.train.config import TrainConfig
from gptlab.train.reference import frozen_reference, reference_forward, token_logps
from gptlab.train.rewards import load_reward, reward_value

GRPO_STATS = ("reward", "completion_tokens", "kl")
_PROBE = "GPTLAB-GRPO-REPLY-PROBE"


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Each reward minus its group's mean, over its group's unbiased std + 1e-4 (groups: `group` consecutive)."""
    grouped = rewards.view(-1, group)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return advantages.view(-1)


def completion_losses(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                      advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float, kl_beta: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each completion's loss, its mean per-token KL to the reference: 0 without one) from (N, T) per-token
    log-probabilities, a (N, T) 0/1 mask of the completions' tokens and (N,) advantages (see the module docstring)."""
    ratio = torch.exp(logps - old_logps)
    a = advantages[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        gap = ref_logps - logps
        kl = torch.exp(gap) - gap - 1
        per_token = per_token + kl_beta * kl * ratio  # importance-weighted: trl's use_bias_correction_kl
    mask = mask.to(logps.dtype)
    tokens = mask.sum(dim=1).clamp(min=1)
    return (per_token * mask).sum(dim=1) / tokens, ((kl * mask).sum(dim=1) / tokens).detach()


def reply_ends(template: ChatTemplate) -> tuple[str, ...]:
    """Where a sampled reply ends: the text the template writes after a reply (whitespace included: "plain"'s
    newline), then its reply stops."""
    text = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}])
    tail = text[text.rfind(_PROBE) + len(_PROBE):] if _PROBE in text else ""
    return tuple(dict.fromkeys([*([tail] if tail else []), *reply_stops(template)]))


def cut_at(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first of `stops` in it."""
    return text[: min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]


def prompts_and_replies(x: torch.Tensor, y: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """Each row's (prompt ids, reply ids): the window up to its first counted target, and the counted targets."""
    rows = []
    for xs, ys in zip(x.tolist(), y.tolist(), strict=True):
        first = next(i for i, t in enumerate(ys) if t != -1)
        rows.append((xs[: first + 1], [t for t in ys if t != -1]))
    return rows


def completion_rows(prompts: list[list[int]], completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of prompt + completion rows, targets on the completions' tokens (-1 elsewhere)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) + 1
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.uint8)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) : len(p) + len(c)] = 1
    return targets_of(ids.numpy(), mask.numpy())


class Grpo:
    """The objective of `train --objective grpo` (see the module docstring)."""

    name = "grpo"
    stats = GRPO_STATS

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, data_dir: Path) -> None:
        self.model, self.group, self.prompts_per_step = model, cfg.group_size, cfg.batch_size
        self.clip_eps, self.kl_beta, self.temperature = cfg.clip_eps, cfg.kl_beta, cfg.temperature
        self.reward, self.reward_name = load_reward(cfg.reward), cfg.reward
        self.tokenizer = load_tokenizer(data_dir)
        name = read_meta(data_dir).get("chat_template")
        template = chat_template_for(self.tokenizer, name if name in BUILTIN_TEMPLATES else None)
        self.stops = reply_ends(template)
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                     stop=list(self.stops))
        self._reference = frozen_reference(model) if cfg.kl_beta > 0 else None
        self._made_tokens = 0  # the input tokens of the rollout rows trained on since `take_made_tokens`

    def take_made_tokens(self) -> int:
        """The input tokens of the rows trained on since the last call, on this process: each rollout's prompt and
        completion as the loss's forward ran them (`group` per prompt), not the prompt windows the feed gave."""
        made, self._made_tokens = self._made_tokens, 0
        return made

    def step_count(self, n_targets: int) -> int:
        """A step's loss and statistics are means over its completions."""
        return self.prompts_per_step * self.group

    def stats_row(self, values: torch.Tensor | None) -> dict[str, float]:
        """The latest step's mean reward, completion length and KL, for metrics.jsonl."""
        return {} if values is None else dict(zip(self.stats, values.tolist(), strict=True))

    @torch.no_grad()
    def rollout(self, prompts: list[list[int]]) -> list[list[int]]:
        """`group` sampled completions of each prompt (token ids, the stop token or string's tokens kept), each
        ending where the model's context does: the loss's forward takes prompt + completion whole, and RoPE's
        generation would otherwise slide on past block_size."""
        repeated = [p for p in prompts for _ in range(self.group)]
        context, most = self.model.config.block_size, self.params.max_new_tokens
        budgets = [max(1, min(most, context - len(p))) for p in repeated]
        completions: list[list[int]] = [[] for _ in repeated]
        for budget in sorted(set(budgets), reverse=True):  # usually one batch: every prompt leaves room for all
            rows = [i for i, b in enumerate(budgets) if b == budget]
            params = dataclasses.replace(self.params, max_new_tokens=budget)
            gens = generate_batch(self.model, [repeated[i] for i in rows], params, tokenizer=self.tokenizer)
            for i, g in zip(rows, gens, strict=True):
                completions[i] = g.token_ids
        return completions

    def score(self, prompts: list[list[int]], replies: list[list[int]], completions: list[list[int]]
              ) -> torch.Tensor:
        """The reward of each completion (`group` per prompt) against its prompt's reply."""
        decode = self.tokenizer.decode
        texts = [(decode(p), cut_at(decode(r), self.stops)) for p, r in zip(prompts, replies, strict=True)]
        return torch.tensor([reward_value(self.reward_name, self.reward(*texts[i // self.group],
                                                                       cut_at(decode(c), self.stops)))
                             for i, c in enumerate(completions)], dtype=torch.float32)

    def loss(self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float,
             documents: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll out, score and take the clipped loss of the micro-step's prompts: the completions' summed loss
        times `scale`, and (summed rewards, completion tokens, per-completion KL)."""
        prompts, replies = zip(*prompts_and_replies(x, y), strict=True)
        completions = self.rollout(list(prompts))
        rewards = self.score(list(prompts), list(replies), completions)
        advantages = group_advantages(rewards, self.group).to(x.device)
        cx, cy = completion_rows([p for p in prompts for _ in range(self.group)], completions)
        self._made_tokens += cx.numel()
        cx, cy = cx.to(x.device), cy.to(x.device)
        logps = token_logps(net, cx, cy, self.temperature)
        ref = None if self._reference is None else -reference_forward(*self._reference, cx, cy, self.temperature)
        mask = cy != -1
        per_completion, kl = completion_losses(logps, logps.detach(), ref, advantages, mask, self.clip_eps,
                                               self.kl_beta)
        stats = torch.stack([rewards.sum(), mask.sum().cpu().float(), kl.sum().cpu().float()])
        return per_completion.sum() * scale, stats.to(x.device)
