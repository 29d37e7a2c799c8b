"""How the engine's rows get their prompts (`Engine`'s prefill half, a mixin of `engine.Engine`).

`add` puts prompts into free rows. Alone (nothing else decoding), they are prefilled at once, together
(`prefill`: one right-padded forward, or a few when their lengths differ much), and each samples its first token.
While other rows decode and the C++ decode step runs this model, they wait for the next `step`, whose C++ call
takes their prompt tokens as more rows beside the running rows' new ones (`_step_rows`, `fast_decode.decode_rows`):
a server's admissions then cost no forward of their own between two steps. With `prefill_chunk`, a longer prompt
goes in that many tokens per step either way (chunked prefill).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from gptlab.errors import GptlabError
from gptlab.generation.accept import score_prompt
from gptlab.generation.fast_decode import decode_rows
from gptlab.generation.logit_filters import TokenCounts
from gptlab.generation.prefill import padded_groups, prefill_rows
from gptlab.generation.prefix_cache import keep_row, restore_prompt
from gptlab.generation.request import FINISH_ERROR, FINISH_LENGTH, Generation
from gptlab.generation.row_steering import any_steered, steering_rows
from gptlab.hooks import hooked_here
from gptlab.kernels.dispatch import BATCH, chosen_ops, kind_of
from gptlab.quantize import QuantizedLinear
from gptlab.rope import length_dependent, past_original_context

if TYPE_CHECKING:
    from gptlab.generation.engine import Engine
    from gptlab.generation.native_decode import NativeWeights

# prompt parts up to this many tokens go into the decode step's C++ call; longer ones take a forward of their own,
# whose attention (flash attention over whole blocks) outruns the step's row-by-row one on long parts
ROWS_STEP_PART = 256


class PromptPrefill:
    """`Engine.add` and what prefills its rows' prompts; the attributes are the engine's (`engine.Engine`)."""

    @torch.inference_mode()
    def add(self: Engine, gens: Sequence[Generation]) -> None:
        """Prefill prompts into free rows (together, `prefill`) and sample each one's first token (with
        prefill_chunk, a longer prompt's first chunk now, the rest in the next steps)."""
        gens = [g for g in gens if not self._done_before_start(g)]
        if not gens:
            return
        free = [i for i, g in enumerate(self.slots) if g is None]
        if len(gens) > len(free):
            raise GptlabError(f"{len(gens)} prompts but only {len(free)} free rows")
        for g, slot in zip(gens, free, strict=False):
            g.row.slot = slot
            self.slots[slot] = g
            g.row.window = list(g.prompt_ids)
            g.prompt_logprobs = [None] if g.params.prompt_logprobs else []
        self._reset_penalty_rows(gens)
        for g in gens:
            kept = restore_prompt(self.prefix_cache, self.model, self.cache, g)  # found there, copied into its row
            self.cache.lengths[g.row.slot] = kept  # (whatever the slot's previous user left)
            g.row.pending = g.prompt_ids[kept:]
        if any(not g.row.pending for g in self.running) and self._rows_step_ready():
            return  # other rows are decoding: these prompts go into their next step (`_step_rows`)
        self._prefill_pending(gens, isolate=len(gens) > 1)

    def _prefill_pending(self: Engine, gens: list[Generation], isolate: bool) -> None:
        """Each row's next prompt part (its pending tokens, up to prefill_chunk) in as few forwards as padding
        allows; rows whose prompt is then in sample their first token. With `isolate`, a forward that fails is
        tried again row by row, and a row that fails alone finishes with its error (the others go on)."""
        parts = [self._next_part(g) for g in gens]
        held = [len(g.prompt_ids) - len(g.row.pending) for g in gens]
        # (a length-dependent scaling's frequencies: each row's own length, which padding would move)
        for group in padded_groups([len(p) for p in parts], held, self.max_len,
                                   unpadded=length_dependent(self.config)):
            rows, error = [gens[i] for i in group], None
            tokens = len(group) * max(len(parts[i]) for i in group)  # padded
            with self._kernels(refresh=True, rows=tokens), steering_rows(self.model, rows):
                try:
                    hidden = prefill_rows(self.model, self.cache, [g.row.slot for g in rows], [parts[i] for i in group])
                except Exception as e:
                    if not isolate:
                        raise
                    error = e
                else:
                    done, logits = self._prompts_in(rows, [parts[i] for i in group], hidden)
            if error is None:
                if done:
                    self._accept(done, logits)
            elif len(rows) > 1:
                for g in rows:
                    self._prefill_pending([g], isolate=True)
            else:
                rows[0].error = error
                rows[0]._finish(FINISH_ERROR)
                self.release(rows[0])

    def _prompts_in(self: Engine, gens: list[Generation], parts: list[list[int]],
                    hidden: torch.Tensor | list[torch.Tensor]) -> tuple[list[Generation], torch.Tensor | None]:
        """After a prefill forward (inside `_kernels`; hidden[i]: row i's (T, C), T >= its part): the parts' prompt
        logprobs scored; the rows whose prompt is now whole, kept by the prefix cache, and the logits after their
        last token (a row asked for no token, there only to be scored, finishes here instead)."""
        done, last = [], []
        for i, (g, part) in enumerate(zip(gens, parts, strict=True)):
            score_prompt(self.model, g, hidden[i][: len(part)], len(g.prompt_ids) - len(g.row.pending))
            g.row.pending = g.row.pending[len(part) :]
            if not g.row.pending:
                keep_row(self.prefix_cache, self.model, self.cache, g)
                if g.params.max_new_tokens == 0:  # prefilled only to be scored (`_done_before_start`): no token
                    g._finish(FINISH_LENGTH)
                    self.release(g)
                    continue
                done.append(g)
                last.append(hidden[i][len(part) - 1])
        return done, self.model.logits(torch.stack(last)) if done else None

    def _next_part(self: Engine, g: Generation) -> list[int]:
        """g's next prompt part: its pending tokens, up to prefill_chunk. All of them for a prompt past the
        pretraining context of a RoPE scaling that depends on the length: a forward's frequencies follow its last
        position, so chunks would rotate the prompt's first keys otherwise than the whole prompt's one forward."""
        if self.prefill_chunk is None or past_original_context(self.config, len(g.prompt_ids)):
            return g.row.pending
        return g.row.pending[: self.prefill_chunk]

    def _done_before_start(self: Engine, g: Generation) -> bool:
        # (a prompt to be scored is prefilled all the same: `_prompts_in` then finishes it with no token)
        if g.params.max_new_tokens == 0 and not g.params.prompt_logprobs:
            g._finish(FINISH_LENGTH)
            return True
        return False

    def _rows_step_ready(self: Engine) -> bool:
        """Whether prompts can go into the decode step's C++ call: the lean step is exact, nothing hooked or steered
        (those run in the plain forward), no captured step, rotary frequencies that do not change with the length,
        and the C++ step's weights not known to be missing."""
        return (self._lean_step_exact and self._static is None and not self.model.training
                and not hooked_here(self.model) and not any_steered(self.slots) and self._native is not False
                and not length_dependent(self.config))

    def _rows_call_serves(self: Engine, n: int) -> bool:
        """Whether n tokens fed to one row go through the decode step's C++ call (`decode_rows`, as a prompt's
        parts do) rather than a forward of their own: speculative decoding's verify and a draft's catch-up."""
        return 1 < n <= ROWS_STEP_PART and self._rows_step_ready() and (n < BATCH or self._many_rows_on_kernel())

    def _feed_row(self: Engine, slot: int, tokens: list[int], weights: NativeWeights) -> torch.Tensor:
        """The logits (T, V) after each of `tokens` fed to row `slot` after what it holds, in one C++ call; the
        row's length moved on."""
        start = int(self.cache.lengths[slot])
        logits = decode_rows(self.model, self.cache, [slot] * len(tokens), list(range(start, start + len(tokens))),
                             tokens, weights, logits=True)
        self.cache.lengths[slot] += len(tokens)
        return logits

    @functools.cached_property
    def _linear_kinds(self: Engine) -> set[str]:
        """The kinds of weight (the dispatch's: fp32, bf16, int8, int4) the model's Linears hold."""
        return {m.mode if isinstance(m, QuantizedLinear) else kind_of(m.weight.dtype)
                for m in self.model.modules() if isinstance(m, (nn.Linear, QuantizedLinear))}

    def _many_rows_on_kernel(self: Engine) -> bool:
        """Whether the dispatch keeps gptlab's kernels for products of many rows (its large-batch probe size) for
        every kind of weight here, as a prefill's forward would (`PackedLinears.active(many_rows=True)`)."""
        return all(chosen_ops(kind, BATCH) is not None for kind in self._linear_kinds)

    def _step_rows(self: Engine, running: list[Generation], prefilling: list[Generation]) -> bool:
        """The running rows' next tokens and the prefilling rows' next prompt parts in one C++ call (`decode_rows`);
        False where that call cannot run, before any row got a token (the separate forwards then do the step)."""
        parts = [self._next_part(g) for g in prefilling]
        if not self._rows_step_ready() or max(len(p) for p in parts) > ROWS_STEP_PART:
            return False
        if len(running) + sum(len(p) for p in parts) >= BATCH and not self._many_rows_on_kernel():
            return False  # PyTorch's products win at this many rows here: the plain forward prefills
        for g in running:
            if len(g.row.window) >= self.max_len:
                self._slide(g)
        lengths = self.cache.lengths.tolist()
        slots = [g.row.slot for g in running]
        positions, tokens = [lengths[s] for s in slots], [g.token_ids[-1] for g in running]
        for g, part in zip(prefilling, parts, strict=True):
            slots += [g.row.slot] * len(part)
            positions += range(lengths[g.row.slot], lengths[g.row.slot] + len(part))
            tokens += part
        with self._kernels(head_only=bool(self._native)):
            weights = self._native_weights()
            if weights is None:
                return False
            h = decode_rows(self.model, self.cache, slots, positions, tokens, weights)  # (R, C)
            logits = self.model.logits(h[: len(running)])
            rows = torch.tensor([g.row.slot for g in running + prefilling], device=self.device)
            self.cache.lengths[rows] += torch.tensor([1] * len(running) + [len(p) for p in parts], device=self.device)
            ends = list(itertools.accumulate([len(running)] + [len(p) for p in parts]))  # each part's rows
            done, done_logits = self._prompts_in(prefilling, parts, [h[a:b] for a, b in itertools.pairwise(ends)])
        for g in running:
            g.row.window.append(g.token_ids[-1])
        self._accept(running, logits)
        if done:
            self._accept(done, done_logits)
        return True

    def _reset_penalty_rows(self: Engine, gens: list[Generation]) -> None:
        if self._penalties is None and any(g.params.penalized for g in gens):
            self._penalties = TokenCounts(self.max_batch, self.config.vocab_size, self.device)
        if self._penalties is not None:
            for g in gens:
                self._penalties.reset(g.row.slot, g.prompt_ids)

