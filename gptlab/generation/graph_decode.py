"""Decode steps of fixed shape, captured once per shape in a CUDA graph and replayed (gpt-fast's recipe).

On a GPU a batch-1 decode step of a small model is a few hundred tiny kernels: the GPU waits on Python launching
them, and every read of a device value (a row's length, the largest position) stalls the queue. This step reads
nothing back: positions and masks come from the cache's lengths on the device, each row writes its keys at its own
position, and attention runs over a host-known number of keys under a mask. Its shapes then depend on the rows and
the keys alone, so both are rounded up to powers of two (rows past the busy ones are idle, keys past a row's length
are masked) and each (rows, keys) shape is captured in a CUDA graph the first time it is needed; a step is one
copy of the new tokens in and one replay.

The step is `fast_decode.decode_hidden` and the LM head, unchanged; on a CPU (tests) it runs uncaptured, and
must equal the plain forward there. Models whose RoPE scaling depends on the sequence length (dynamic NTK,
longrope) read that length every step and decode the usual way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from gptlab.generation.fast_decode import decode_hidden, lean_step_exact
from gptlab.kv_cache import KVCache
from gptlab.model import GPT
from gptlab.rope import length_dependent

log = logging.getLogger(__name__)

MIN_KEYS = 64  # the smallest key bucket: a few more masked keys cost less than more captures


def usable(model: GPT) -> bool:
    """Whether `StaticDecode` computes exactly what the model's forward does for it (see the module docstring)."""
    return lean_step_exact(model) and not length_dependent(model.config)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class StaticDecode:
    """The engine's decode step over rows 0.. of `cache`: `rows_for` says how many rows a step computes, `__call__`
    runs it (replaying its CUDA graph when `capture`) and returns the logits of every computed row."""

    def __init__(self, model: GPT, cache: KVCache, capture: bool, compile: bool = False) -> None:
        self.model, self.cache, self.capture = model, cache, capture
        # torch.compile fuses the step's small ops (norms, RoPE, residual adds) into fewer kernels: fewer launches per
        # replay, at a compilation per shape (seconds to a minute each); so compiled steps attend over the whole
        # cache (size it to what the rows need, as transformers' static cache is): one shape per row count
        self.compiled = compile
        self._run = torch.compile(self._step, dynamic=False) if compile else self._step
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every capture
        self._primed: set[int] = set()  # row counts the step has run uncompiled (see _prime)

    def rows_for(self, busy: int) -> int:
        """Rows a step computes when rows 0..busy-1 hold the busy ones (the rest of them must be idle)."""
        return min(_power_of_two_at_least(busy), self.cache.batch_size)

    def keys_for(self, longest: int) -> int:
        """Keys attended over when the longest row will hold `longest` tokens after this step."""
        if self.compiled:
            return self.cache.max_len
        return min(max(_power_of_two_at_least(longest), MIN_KEYS), self.cache.max_len)

    def _step(self, tokens: torch.Tensor, keys: int) -> torch.Tensor:
        view = self.cache.rows(0, tokens.shape[0])
        h = decode_hidden(self.model, tokens, view, native=None, keys=keys)  # (rows, 1, C)
        return self.model.logits(h[:, -1])  # (rows, V)

    def __call__(self, tokens: torch.Tensor, longest: int) -> torch.Tensor:
        """Logits (rows, V) for the newest token of each row (tokens (rows, 1), on the host), appended to the cache;
        `longest`: the most tokens any of these rows holds after the step."""
        keys = self.keys_for(longest)
        if self.compiled and tokens.shape[0] not in self._primed:
            self._prime(tokens.shape[0], keys)
        if not self.capture:
            return self._run(tokens.to(self.cache.lengths.device), keys)
        shape = (tokens.shape[0], keys)
        if shape not in self._graphs:
            try:
                self._graphs[shape] = self._record(*shape)
            except RuntimeError as e:  # a capture this build or driver refuses: the same step, launched each time
                log.warning("decoding without CUDA graphs: capturing a step failed: %s", e)
                self.capture = False
                return self(tokens, longest)
        graph, tokens_in, logits_out = self._graphs[shape]
        tokens_in.copy_(tokens, non_blocking=True)
        graph.replay()
        return logits_out.clone()  # the next replay overwrites the graph's output

    @contextlib.contextmanager
    def _lengths_kept(self) -> Iterator[torch.Tensor]:
        """The rows' lengths as they are now (yielded, to put back between runs), restored however the block
        ends: steps run outside the engine's own (warm-ups, priming) write keys only where its next step will
        write its own, and leave the rows holding what they held."""
        lengths = self.cache.lengths
        saved = lengths.clone()
        try:
            yield saved
        finally:
            lengths.copy_(saved)

    def _prime(self, rows: int, keys: int) -> None:
        """Run the step once uncompiled at this row count: what layers make on their first call (a quantized
        layer's choice of kernel and its copies of the weights) then exists before torch.compile traces the
        step; made while tracing, it would break the graph at every layer."""
        with self._lengths_kept():
            self._step(torch.zeros(rows, 1, dtype=torch.long, device=self.cache.lengths.device), keys)
        self._primed.add(rows)

    def _record(self, rows: int, keys: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """Capture one step of this shape. Warm-up runs first (on a side stream, as CUDA graphs require), each
        putting the rows' lengths back."""
        lengths = self.cache.lengths
        tokens_in = torch.zeros(rows, 1, dtype=torch.long, device=lengths.device)
        with self._lengths_kept() as saved:
            side = torch.cuda.Stream(lengths.device)
            side.wait_stream(torch.cuda.current_stream(lengths.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(tokens_in, keys)
                    lengths.copy_(saved)
            torch.cuda.current_stream(lengths.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads (a server's other endpoints) may go on during the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits_out = self._run(tokens_in, keys)
        return graph, tokens_in, logits_out
