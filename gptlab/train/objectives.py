"""What a training step minimizes: the seam between the one training loop and its losses.

`LanguageModeling` is next-token cross-entropy over the counted targets (pretraining, SFT). `Preference` is DPO,
IPO, SimPO and ORPO over preference pairs (`gptlab prepare` of prompt / chosen / rejected records: each pair is two
consecutive rows, chosen then rejected, targets on the replies' tokens). Both give, per micro-step, the loss
already scaled to its share of the global batch's mean, and a vector of statistics summed over the micro-step;
the trainer does everything else (accumulation, the optimizer, resume) the same way for both.

DPO (Rafailov et al. 2023), as trl's DPOTrainer computes it: a reply's log-probability is the sum of its tokens'
log-probabilities; h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)); the loss of a pair is
-log sigmoid(beta h), with label smoothing eps (conservative DPO) -(1 - eps) log sigmoid(beta h) - eps log
sigmoid(-beta h). IPO (Azar et al. 2023, trl's "ipo"): the log-ratios averaged over each reply's tokens, the loss
(h - 1 / (2 beta))^2. Rewards are beta times each reply's summed log-ratio, as trl logs them.

Two need no reference (no copy, no second forward): SimPO (Meng et al. 2024, trl's CPOTrainer with loss_type
"simpo", cpo_alpha 0): the replies' average log-probabilities a(c), a(r), the loss -log sigmoid(beta (a(c) - a(r))
- gamma) (label smoothing as DPO's); ORPO (Hong et al. 2024): the chosen reply's negative average log-probability
plus beta times -log sigmoid of the log odds ratio, log(p(c) / (1 - p(c))) - log(p(r) / (1 - p(r))) with p the
average per-token probability (the paper's; trl's ORPOTrainer also counts the prompt's tokens in its NLL term).
Their rewards are beta times the average log-probabilities, as trl logs them.

The reference is the starting weights, frozen (`reference`: with LoRA the base with its adapters off, else a
frozen copy). Its log-probabilities are computed once per step, without gradients. GRPO, whose step samples its
own completions, is `grpo`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from gptlab.errors import GptlabError
from gptlab.hooks import eval_mode
from gptlab.train.config import TrainConfig
from gptlab.train.reference import frozen_reference, reference_forward

if TYPE_CHECKING:
    from gptlab.train.grpo import Grpo

PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_OBJECTIVES = ("dpo", "ipo")  # the others compare the replies under the policy alone
REWARD_STATS = ("rewards_chosen", "rewards_rejected", "reward_accuracy")


def sequence_logps(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's counted targets, their number): targets of -1 count nothing."""
    _, losses = net(x, y, reduction="none", check_ids=False)  # -log p per target, 0 where it is -1
    return -losses.view(y.shape).sum(dim=1), (y != -1).sum(dim=1)


class LanguageModeling:
    """Cross-entropy summed over a micro-step's counted targets; the step divides by all of its targets."""

    name = "lm"
    stats: tuple[str, ...] = ()

    def stats_row(self, values: torch.Tensor | None) -> dict[str, float]:
        """The metrics.jsonl columns of a step's statistics (per pair); none for language modeling."""
        return {}

    def step_count(self, n_targets: int) -> int:
        """What a step's loss and statistics are the mean over: its counted targets (pairs, for `Preference`)."""
        return n_targets

    def take_made_tokens(self) -> int | None:
        """The input tokens of rows the objective made itself since the last call (GRPO's rollouts), on this
        process; None: it trains on the feed's rows, which the feed counts."""
        return None

    def loss(self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float,
             documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`documents`: with document_mask, which packed document each input token is in (see GPT.forward)."""
        kw = {} if documents is None else {"documents": documents}
        _, loss = net(x, y, reduction="sum", check_ids=False, **kw)  # the feed checked the ids
        return loss * scale, loss.new_zeros(0)


class Preference:
    """DPO or IPO against a frozen reference (see the module docstring). Rows come in pairs: chosen, rejected."""

    stats = REWARD_STATS
    step_count = LanguageModeling.step_count  # the feed counts a batch of pairs in pairs
    take_made_tokens = LanguageModeling.take_made_tokens  # it trains on the feed's rows

    def __init__(self, name: str, beta: float, label_smoothing: float, model: torch.nn.Module,
                 simpo_gamma: float = 0.5) -> None:
        self.name, self.beta, self.label_smoothing, self.simpo_gamma = name, beta, label_smoothing, simpo_gamma
        self._reference: torch.nn.Module | None = None
        self._context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if name in REFERENCE_OBJECTIVES:
            self._reference, self._context = frozen_reference(model)

    def stats_row(self, values: torch.Tensor | None) -> dict[str, float]:
        """The latest step's rewards per pair, its reward margin and accuracy, for metrics.jsonl (one host read)."""
        if values is None:
            return {}
        row = dict(zip(self.stats, values.tolist(), strict=True))
        return {**row, "reward_margin": row["rewards_chosen"] - row["rewards_rejected"]}

    def reference(self) -> tuple[torch.nn.Module | None, Callable[[], contextlib.AbstractContextManager]]:
        return self._reference, self._context

    def pair_losses(self, logps: torch.Tensor, counts: torch.Tensor, ref_logps: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss of each pair, chosen rewards, rejected rewards) from the rows' summed log-probabilities (rows:
        chosen, rejected, chosen, ...), their target counts and the reference's (None: no reference)."""
        eps = self.label_smoothing
        if ref_logps is None:
            average = logps / counts.clamp(min=1)
            chosen, rejected = average[0::2], average[1::2]
            if self.name == "simpo":
                h = self.beta * (chosen - rejected) - self.simpo_gamma
                losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
            else:  # orpo
                log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
                losses = -chosen - self.beta * F.logsigmoid(log_odds)
            return losses, self.beta * chosen.detach(), self.beta * rejected.detach()
        ratios = logps - ref_logps
        chosen, rejected = ratios[0::2], ratios[1::2]
        if self.name == "ipo":
            per_token = ratios / counts.clamp(min=1)
            losses = (per_token[0::2] - per_token[1::2] - 1 / (2 * self.beta)) ** 2
        else:
            h = self.beta * (chosen - rejected)
            losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
        return losses, self.beta * chosen.detach(), self.beta * rejected.detach()

    def loss(self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float,
             documents: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-step's pairs' summed loss times `scale`, and (sum of chosen rewards, of rejected rewards,
        pairs whose chosen reward is the higher)."""
        logps, counts = sequence_logps(net, x, y)
        with torch.no_grad():
            ref_logps = self.reference_logps(x, y)
        losses, chosen, rejected = self.pair_losses(logps, counts, ref_logps)
        stats = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).sum().to(chosen.dtype)])
        return losses.sum() * scale, stats.float()

    @torch.no_grad()
    def reference_logps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        reference, context = self.reference()
        if reference is None:
            return None
        return -reference_forward(reference, context, x, y).sum(dim=1)

    @torch.no_grad()
    def evaluate(self, module: torch.nn.Module, rows: Iterator[tuple[torch.Tensor, torch.Tensor]],
                 autocast: contextlib.AbstractContextManager) -> float:
        """The mean loss over every pair of `rows` (batches of (inputs, targets), pairs whole)."""
        total, pairs = torch.zeros((), dtype=torch.float64), 0
        with eval_mode(module), autocast:
            for x, y in rows:
                logps, counts = sequence_logps(module, x, y)
                losses, _, _ = self.pair_losses(logps, counts, self.reference_logps(x, y))
                total += losses.double().sum().cpu()
                pairs += len(losses)
        return float(total) / max(pairs, 1)


def build_objective(cfg: TrainConfig, model: torch.nn.Module, data_dir: Path | None = None
                    ) -> LanguageModeling | Preference | Grpo:
    """The recipe's objective; one with a reference takes it from `model` now (the starting weights). GRPO
    samples with `model` and reads the tokenizer and chat template of `data_dir`."""
    if cfg.objective == "grpo":
        from gptlab.train.grpo import Grpo  # its sampling engine: imported by the runs that use it

        if data_dir is None:
            raise GptlabError("objective grpo needs the data directory its prompts come from")
        return Grpo(cfg, model, data_dir)
    if cfg.objective in PREFERENCE_OBJECTIVES:
        return Preference(cfg.objective, cfg.beta, cfg.label_smoothing, model, cfg.simpo_gamma)
    return LanguageModeling()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation either side of -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def check_objective_data(objective: str, meta: dict[str, Any], data_dir: Path) -> None:
    """Preference objectives train on pairs and nothing else trains on them, GRPO on prompts one per window: a
    one-line error for a mismatch."""
    pairs = meta.get("layout") == "pairs"
    if objective == "grpo" and meta.get("layout") != "padded":
        raise GptlabError(f"objective grpo samples replies to the prompts of prompt/completion (or chat) records, one "
                          f"per window; {data_dir} holds {meta.get('layout') or 'running text'}: prepare the records "
                          "with --no-pack")
    if objective in PREFERENCE_OBJECTIVES and not pairs:
        raise GptlabError(f"objective {objective} trains on preference pairs; {data_dir} holds none: prepare records "
                          "with prompt, chosen and rejected fields")
    if objective not in PREFERENCE_OBJECTIVES and pairs:
        raise GptlabError(f"{data_dir} holds preference pairs: train on them with --objective dpo (or ipo, simpo, "
                          "orpo)")
