"""The generation engine: batched, KV-cached decoding behind `gptlab.generate`, `gptlab sample` and `gptlab serve`.

* `Engine` owns a `KVCache` of `max_batch` rows, allocated once. `add` prefills prompts into any free rows
  together (`prefill`: one right-padded forward, or a few when their lengths differ much) and samples each row's
  first token, or, while other rows decode on the C++ step, leaves them to the next step's call (`engine_prefill`);
  `step` feeds every running row its last token and samples the next. Rows finish on their own
  ("stop" or "length") and free their slot, so new requests can join between steps (continuous batching).
  With `prefill_chunk`, a longer prompt is prefilled that many tokens per step, alongside the other rows'
  decoding, so one long prompt does not stall everybody else for a whole prefill (chunked prefill); but a prompt
  past the pretraining context of a RoPE scaling that depends on the length (dynamic, longrope) goes in whole,
  since its chunks would be rotated otherwise than its one forward.
* With a `PrefixCache` (`prefix_cache`), a prompt's longest kept beginning is copied into its row and only the
  rest is prefilled; each row's tokens are kept when its prompt is in and when it ends (so the next chat turn or
  request that repeats them reuses them).
* With `speculate` (a draft model, or "ngram": prompt lookup), a row decoding alone checks several guessed
  tokens per forward and keeps those the target would have produced (`speculative`).
* Each row's state is a `Generation`, made by `prepare` (`rows`: the prompt's checks and truncation, stop
  tokens, its random generator, its text).

Each row samples under its own `SamplingParams` (`params`) with the filters of `sampling`; the one-call helpers
over a throwaway engine are in `api`.

Context limits. A prompt must leave room for one new token (at most block_size - 1 tokens): longer ones raise
`PromptTooLongError` unless `truncate_prompt=True` (see `rows`). With learned positions a row ends with finish
reason "length" when prompt + generated tokens reach block_size. With RoPE (or no positions) generation goes on
past block_size as a sliding window: when a row's cache is full, its last block_size // 2 tokens are prefilled
again from position 0 (RoPE only sees relative positions) and decoding continues; what came earlier is
forgotten.

Precision: the model runs in its own dtype (bf16 weights make decoding ~2x faster on CPUs); the logits are
cast to fp32 before any sampling arithmetic.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from gptlab.errors import GptlabError
from gptlab.generation import native_decode
from gptlab.generation.accept import finish_rows, record_logprobs, sample_rows
from gptlab.generation.engine_prefill import PromptPrefill
from gptlab.generation.fast_decode import decode_greedy, decode_logits, lean_step_exact
from gptlab.generation.graph_decode import StaticDecode, usable
from gptlab.generation.logit_filters import TokenCounts
from gptlab.generation.packed_linear import kernel_name, pack_where_it_helps
from gptlab.generation.params import SamplingParams
from gptlab.generation.prefill import prefill_rows
from gptlab.generation.prefix_cache import PrefixCache, keep_row
from gptlab.generation.request import (
    FINISH_STOP,
    Generation,
    prepare_generation,
)
from gptlab.generation.row_steering import any_steered, steering_rows
from gptlab.generation.speculative import DRAFT_TOKENS, Speculate, Speculator
from gptlab.generation.step_choice import decode_path, step_cache_dtype
from gptlab.hardware import available_memory
from gptlab.hooks import hooked_here
from gptlab.kernels.dispatch import BATCH
from gptlab.kv_cache import KVCache, cache_bytes, default_cache_dtype
from gptlab.model import GPT
from gptlab.quantize import QuantizedLinear
from gptlab.steering import SteeringVector, check_vectors

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer


# the share of the free memory a KV cache may take: the rest is for what the engine allocates beside it (packed
# weights, a step's activations and logits, a prefill's). A SmolLM2-135M server of 64 rows x 8,192 positions in fp32
# (22.5 GiB of cache, 22.9 GiB free) passed a check against all of it and was killed for memory when it filled
CACHE_SHARE_OF_FREE_MEMORY = 0.9


def check_cache_memory(config: Any, max_batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a batch whose KV cache cannot fit, in one line, before trying to allocate it."""
    need, have = cache_bytes(config, max_batch, max_len, dtype), available_memory(device)
    if have is not None and need > CACHE_SHARE_OF_FREE_MEMORY * have:
        kind = str(dtype).removeprefix("torch.")
        raise GptlabError(f"max_batch {max_batch} needs {need / 2**30:.1f} GiB of KV cache in {kind} "
                          f"({max_len} positions a row), more than {CACHE_SHARE_OF_FREE_MEMORY:.0%} of the "
                          f"{have / 2**30:.1f} GiB free: use a smaller batch or fewer positions a row (max_len; "
                          f"`gptlab serve --max-model-len`)")


# ---------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------
class Engine(PromptPrefill):
    """Batched decoding over one preallocated KV cache of `max_batch` rows; see the module docstring."""

    def __init__(
        self,
        model: GPT,
        max_batch: int = 1,
        *,
        tokenizer: TextTokenizer | None = None,
        max_len: int | None = None,
        cache_dtype: torch.dtype | None = None,
        pack_weights: bool = True,
        prefill_chunk: int | None = None,
        static_decode: bool | None = None,
        compile_decode: bool = False,
        prefix_cache: PrefixCache | None = None,
        speculate: Speculate | None = None,
        draft_tokens: int = DRAFT_TOKENS,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be >= 1 (or None: the model's block_size), got {max_len}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (or None), got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache  # prompts' beginnings kept and reused across requests (`prefix_cache`)
        self.model, self.config, self.tokenizer = model, model.config, tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len = min(max_len or self.config.block_size, self.config.block_size)
        # on CPUs: copies of the Linear weights laid out for faster kernels, used for the engine's own forwards;
        # the model's, made by its first engine and reused by the next (only changed weights are packed again)
        # (not under torch.compile: it cannot trace into the C++ kernels, and compiles its own)
        # (the Linears on the path whose whole decode step was timed fastest for this model and batch; the KV cache
        # stored as that step reads it fastest, attended in the default dtype: `step_cache_dtype`)
        attend_dtype = cache_dtype or default_cache_dtype(self.device, self.dtype)
        # (before any timing: the narrower of the caches a step may choose; then the one chosen)
        narrowest = min(attend_dtype, native_decode.cache_dtype(model), key=lambda d: d.itemsize)
        check_cache_memory(self.config, max_batch, self.max_len, cache_dtype or narrowest, self.device)
        path = decode_path(model, max_batch, cache_dtype) if pack_weights and not compile_decode else None
        cache_dtype = cache_dtype or (step_cache_dtype(model, path) if path else attend_dtype)
        check_cache_memory(self.config, max_batch, self.max_len, cache_dtype, self.device)
        self.cache = KVCache(self.config, max_batch, self.max_len, device=self.device, dtype=cache_dtype,
                             attend_dtype=attend_dtype)
        self.slots: list[Generation | None] = [None] * max_batch
        self._penalties: TokenCounts | None = None  # made when a row first asks for a penalty
        self._packed = pack_where_it_helps(model, max_batch, path) if pack_weights and not compile_decode else None
        self._lean_step_exact = lean_step_exact(model)  # decode steps skip the general forward's framework time
        # The weights are checked for changes (and packed again) when prompts are prefilled, not before every
        # decode step, and the C++ step's weight list is kept until they change (a per-step walk over every Linear
        # cost ~5% of a batch-1 token): weights written while rows are decoding count from the next prefill.
        self._native: native_decode.NativeWeights | bool | None = None  # None: not gathered yet; False: cannot
        # on a GPU: decode steps of fixed shape, each captured once in a CUDA graph (`static_decode=True` on a CPU
        # runs the same step uncaptured; None: on CUDA, where the model allows it)
        on_gpu = self.device.type == "cuda"
        static = on_gpu if static_decode is None else static_decode
        self._static = (StaticDecode(model, self.cache, capture=on_gpu, compile=compile_decode)
                        if static and usable(model) else None)
        # speculative decoding (a draft model's or prompt lookup's guesses, checked in one forward) while one
        # row runs alone (`speculative`)
        self.speculator = None if speculate is None else Speculator(self, speculate, draft_tokens)

    def _kernels(self, refresh: bool = False, head_only: bool = False,
                 rows: int = 1) -> contextlib.AbstractContextManager:
        """The packed forwards for a forward of `rows` token rows (all of them, or the LM head's alone); from
        the dispatch's large-batch probe size on, the blocks on a build for the C++ step keep their plain forward
        (where they were sent to a build, PyTorch's path won the products at that size)."""
        if self._packed is None:
            return contextlib.nullcontext()
        if refresh and self._packed.refresh():
            self._native = None  # packs made anew: gather the C++ step's weights again
        return self._packed.active(refresh=False, only=self.model.lm_head if head_only else None,
                                   many_rows=rows >= BATCH)

    def _native_weights(self) -> native_decode.NativeWeights | None:
        """The C++ decode step's weights (inside `_kernels()`), gathered on the first decode step."""
        if self._native is None:
            self._native = native_decode.weights(self.model, self.cache) or False
        return self._native or None

    def kernels(self) -> dict[str, Any]:
        """What runs this engine's decode steps on this machine: the decode step ("native C++": the blocks in one
        call, "lean", or "plain": the general forward) and each Linear's kernel, counted by name."""
        with self._kernels():
            rows = self.cache.batch_size
            names = Counter(kernel_name(m) if isinstance(m, nn.Linear) else m.kernel_name(self.dtype, rows)
                            for m in self.model.modules() if isinstance(m, (nn.Linear, QuantizedLinear)))
            native = self._native_weights() is not None
        step = "native C++" if self._lean_step_exact and native else "lean" if self._lean_step_exact else "plain"
        if self._static is not None:
            step = "CUDA graph" if self._static.capture else "static"
        return {"decode step": step, "linears": dict(names)}

    # --- bookkeeping ----------------------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return len(self.slots)

    @property
    def running(self) -> list[Generation]:
        return [g for g in self.slots if g is not None]

    def free_slots(self) -> int:
        return sum(g is None for g in self.slots)

    def release(self, gen: Generation) -> None:
        """Free a row (finished or cancelled): the prefix cache keeps what it holds; its cache entries are then
        overwritten by the next user."""
        if 0 <= gen.row.slot < self.max_batch and self.slots[gen.row.slot] is gen:
            keep_row(self.prefix_cache, self.model, self.cache, gen)
            self.slots[gen.row.slot] = None
        if not gen.finished:
            gen._finish(FINISH_STOP)

    def prepare(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        sample_index: int = 0,
        truncate_prompt: bool = False,
        steering: Sequence[SteeringVector] = (),
    ) -> Generation:
        """Check (or truncate) a prompt and build its row state; `add` then prefills it. `steering`: vectors
        added to this row's residual stream alone (`row_steering`)."""
        gen = prepare_generation(prompt_ids, params, vocab_size=self.config.vocab_size, context=self.max_len,
                                 tokenizer=self.tokenizer, device=self.device, sample_index=sample_index,
                                 truncate_prompt=truncate_prompt)
        gen.steering = check_vectors(self.model, steering)
        return gen

    # --- decoding -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Generation]:
        """Feed every running row its newest token and sample the next, and give each row still prefilling its
        next prompt chunk; returns the rows that got a token."""
        prefilling = [g for g in self.running if g.row.pending]
        running = [g for g in self.running if not g.row.pending]
        if self.speculator is not None and len(running) == 1 and not prefilling and self.speculator.step(running[0]):
            return running
        if running and prefilling and self._step_rows(running, prefilling):
            return running + [g for g in prefilling if g.token_ids]
        if running:
            self._decode(running, prefilling)
        if prefilling:  # one more chunk of each long prompt; the last one samples its first token
            self._prefill_pending(prefilling, isolate=True)
        return running + [g for g in prefilling if g.token_ids]

    def _decode(self, running: list[Generation], prefilling: list[Generation]) -> None:
        for g in running:
            if len(g.row.window) >= self.max_len:  # the window is what the row's cache holds
                self._slide(g)
        hi = max(g.row.slot for g in running + prefilling) + 1  # rows past the last busy one are left out
        # hook points set (`gptlab.hooks`), or a steered row's: they run in the plain forward
        hooked = hooked_here(self.model) or any_steered(self.slots[:hi])
        static = self._static is not None and not self.model.training and not hooked
        if static:
            hi = self._static.rows_for(hi)
        idle = [i for i in range(hi) if self.slots[i] is None]
        slots = [g.row.slot for g in running]
        if slots == list(range(hi)):  # every row of the step a running row, in slot order (as at batch 1)
            tokens, rows = torch.tensor([[g.token_ids[-1]] for g in running]), slice(None)
        else:
            tokens = torch.zeros(hi, 1, dtype=torch.long)
            tokens[slots, 0] = torch.tensor([g.token_ids[-1] for g in running])
            rows = torch.tensor(slots, device=self.device)
        view = self.cache.rows(0, hi)
        if idle:
            view.lengths[idle] = 0  # idle rows compute a throwaway token at position 0
        # (the C++ step, gathered before, reads its packs itself)
        with self._kernels(head_only=bool(self._native)), steering_rows(self.model, self.slots[:hi]):
            if static:  # the rows' lengths after this step, known here: the cache holds each row's window
                longest = max([len(g.row.window) + 1 for g in running]
                              + [len(g.prompt_ids) - len(g.row.pending) + 1 for g in prefilling])
                logits = self._static(tokens, longest)[rows]
            elif self._lean_step_exact and not self.model.training and not hooked:
                logits = decode_logits(self.model, tokens.to(self.device), view, self._native_weights(),
                                       None if isinstance(rows, slice) else slots)
            else:
                h = self.model.hidden_states(tokens.to(self.device), kv_cache=view)
                logits = self.model.logits(h[rows, -1])
        if idle:
            view.lengths[idle] = 0
        for g in prefilling:  # their throwaway token sits where their next chunk will be written
            view.lengths[g.row.slot] -= 1
        for g in running:
            g.row.window.append(g.token_ids[-1])
        self._accept(running, logits)

    @torch.inference_mode()
    def forward_row(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` to row `slot` after those it holds: the logits (T, V) after each one (speculative
        decoding's draft and verify forwards; the caller keeps the row's bookkeeping)."""
        view = self.cache.rows(slot, slot + 1)
        idx = torch.tensor([tokens], device=self.device)
        with steering_rows(self.model, self.slots, first=slot):
            lean = (len(tokens) == 1 and self._lean_step_exact and not self.model.training
                    and not hooked_here(self.model))
            rows = not lean and self._rows_call_serves(len(tokens))  # several tokens in the C++ step's one call
            with self._kernels(head_only=(lean or rows) and bool(self._native)):
                if lean:
                    return decode_logits(self.model, idx, view, self._native_weights())
                if rows and (weights := self._native_weights()) is not None:
                    return self._feed_row(slot, tokens, weights)
                return self.model.logits(self.model.hidden_states(idx, kv_cache=view)[0])

    @torch.inference_mode()
    def greedy_row(self, token: int, steps: int) -> list[int] | None:
        """A one-row engine's next `steps` greedy tokens after feeding `token` (each the argmax after the one before,
        fed in turn), in one C++ call (`decode_greedy`: a draft model's guesses); None where that call cannot run
        (the caller then steps one token at a time)."""
        if (self.cache.batch_size != 1 or not self._lean_step_exact or self.model.training
                or hooked_here(self.model) or any_steered(self.slots)):
            return None
        with self._kernels(head_only=bool(self._native)):
            weights = self._native_weights()
            return None if weights is None else decode_greedy(self.model, token, self.cache, weights, steps)

    def record(self, g: Generation, logits: torch.Tensor, tokens: list[int]) -> int:
        """Give row g its new tokens in order, each sampled from its row of `logits` (for logprobs), until it
        finishes: how many it took."""
        for i, tok in enumerate(tokens):
            record_logprobs([g], logits[i : i + 1], [tok])
            finish_rows([g], [tok], self.config, self.max_len, self.release)
            if g.finished:
                return i + 1
        return len(tokens)

    def _slide(self, g: Generation) -> None:
        """A row whose cache is full keeps its last max_len // 2 tokens, prefilled again from position 0.

        Only RoPE (or position-free) rows get here: learned-position rows finish at max_len first."""
        n_keep = self.max_len // 2 - 1  # + the pending token, fed by the step that follows
        keep = g.row.window[len(g.row.window) - n_keep :] if n_keep > 0 else []
        g.row.window = list(keep)
        self.cache.lengths[g.row.slot] = 0
        if keep:
            with self._kernels(refresh=True, rows=len(keep)), steering_rows(self.model, [g]):
                prefill_rows(self.model, self.cache, [g.row.slot], [keep])

    def _accept(self, gens: list[Generation], logits: torch.Tensor) -> None:
        """Sample one token per row, record it, and finish / free the rows that are done (`accept`'s jobs)."""
        counts = self._penalties
        slots = torch.tensor([g.row.slot for g in gens], device=self.device) if counts is not None else None
        new = sample_rows(gens, logits, *(counts.rows(slots) if counts is not None else (None, None)), self.release)
        if None in new:  # rows that failed are gone: go on with the others
            ok = [i for i, t in enumerate(new) if t is not None]
            gens, new, logits = [gens[i] for i in ok], [new[i] for i in ok], logits[ok]
            slots = None if slots is None else slots[ok]
            if not gens:
                return
        record_logprobs(gens, logits, new)
        if counts is not None:
            counts.add(slots, new)
        finish_rows(gens, new, self.config, self.max_len, self.release)

    # --- whole runs -----------------------------------------------------------------------------------------
    def run(self, gens: Sequence[Generation]) -> list[Generation]:
        """Prefill `gens` (at most max_batch) and decode until every one has finished."""
        self.add(gens)
        while self.running:
            self.step()
        for g in gens:
            if g.error is not None:
                raise g.error
        return list(gens)
