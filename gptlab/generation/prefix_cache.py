"""Prefix caching: the keys and values of token sequences' beginnings, kept across requests and chat turns, so a
prompt that starts like an earlier one (a system prompt, the conversation so far) prefills only what is new.

The engine asks two things (`Engine(prefix_cache=...)`):

    n = cache.restore(kv, row, prompt)   # copy the longest kept prefix of `prompt` into row `row`: n tokens
    cache.store(kv, row, tokens)         # row `row` holds `tokens` from position 0: keep their whole blocks

**Hashed fixed-size blocks, not a radix tree.** A block is `block_tokens` tokens; its key is (its parent block's
id, its tokens), so a block stands for its tokens *and every token before them*, and the longest cached prefix is
found with one dictionary probe per block (the tuple is compared in full: no hash collision can return another
prefix's keys). Every block has the same size, so the memory budget is a number of blocks and eviction needs no
size arithmetic. A radix tree (SGLang) matches to the token, which saves at most `block_tokens - 1` tokens of
prefill per request: little next to the prompt lengths where caching pays, for a structure whose nodes split.

**Least recently used first.** A hit or a store touches its chain from the last block to the first, so a block is
always more recent than every block after it: the least recently used block is a leaf, and eviction never leaves a
block whose parent is gone.

**Exact, or not at all.** The model computes a token's keys and values from it and the tokens before it, at its
position; a kept block holds them for positions counted from 0, the only place `restore` puts them, whatever the
position scheme (learned, RoPE of any layout) or attention pattern (sliding windows: the cache keeps every key and
masks; gptlab has no attention-sink models). Numbers can differ in the last bits only, as any two batch shapes'
sums do. Reuse is refused where it would not be exact:

* RoPE scalings whose frequencies depend on the forward's last position (dynamic NTK, longrope): blocks are kept
  and reused only for sequences that stay within the pretraining context, where every forward uses the same ones;
* a model in training mode (dropout);
* a model with hook points set (`gptlab.hooks`: a whole model `steered`, a patch): its keys are not the plain
  model's, so none are kept or restored while they are set (a row's own steering: `restore_prompt`);
* weights written since a block was kept (each parameter's version counter; writes through `.data` are not
  seen, as for the packed CPU weights): every block is dropped;
* a KV cache of another shape, dtype or device, or another model: every block is dropped.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from gptlab.hooks import hooked_here
from gptlab.kv_cache import KVCache
from gptlab.rope import past_original_context

if TYPE_CHECKING:
    from gptlab.generation.request import Generation

DEFAULT_PREFIX_CACHE_MB = 512.0  # the server's and chat's default budget: a GPT-2 124M context is ~75 MB (fp32)
DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counts since the cache was made: lookups, the prompt tokens they asked about and those found; the blocks kept
    now, their bytes, the budget, and the blocks evicted to stay within it."""

    queries: int
    query_tokens: int
    hit_tokens: int
    blocks: int
    bytes: int
    budget_bytes: int
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        """The share of looked-up prompt tokens that were not prefilled (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(eq=False)
class _Block:
    id: int
    key: tuple[int, tuple[int, ...]]  # (parent block's id, 0 for the first block; its tokens)
    k: torch.Tensor  # (n_layer, n_kv_head, block_tokens, head_size)
    v: torch.Tensor
    shifted: torch.Tensor | None  # a token-shift model's shifted vectors (points, block_tokens, C), else None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.shifted is None else self.shifted.nbytes)


class PrefixCache:
    """Blocks of keys and values of token prefixes within `budget_bytes`, least recently used evicted first; see the
    module docstring. One can outlive an engine (a chat session's engine is remade as the conversation grows)."""

    def __init__(self, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if budget_bytes < 1:
            raise ValueError(f"a prefix cache needs a budget of at least 1 byte, got {budget_bytes}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.budget_bytes, self.block_tokens = int(budget_bytes), block_tokens
        self._blocks: collections.OrderedDict[tuple, _Block] = collections.OrderedDict()  # oldest first
        self._ids = itertools.count(1)
        self._owner: tuple | None = None  # (model ref, cache layout, weights' fingerprint) the blocks belong to
        self._queries = self._query_tokens = self._hit_tokens = self._evicted = 0
        self._bytes = 0  # of the blocks kept (a count, so that `stats` never walks the blocks another thread changes)

    @classmethod
    def of_megabytes(cls, megabytes: float, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> PrefixCache | None:
        """A cache of `megabytes` MB (2**20 bytes), or None for 0: caching off."""
        if not megabytes >= 0:  # (also refuses nan)
            raise ValueError(f"a prefix cache budget is 0 (off) or more megabytes, got {megabytes}")
        return cls(int(megabytes * 2**20), block_tokens) if megabytes > 0 else None

    # --- the engine's two calls -----------------------------------------------------------------------------
    @torch.inference_mode()
    def restore(self, model: nn.Module, kv: KVCache, row: int, prompt: Sequence[int]) -> int:
        """Copy the longest kept prefix of `prompt` (whole blocks, leaving at least its last token to compute) into
        row `row` of `kv` from position 0, and return its length (0: nothing kept, or reuse is not exact here)."""
        self._queries += 1
        self._query_tokens += len(prompt)
        if not self._usable(model, kv, len(prompt)):
            return 0
        chain = self._chain(prompt[: len(prompt) - 1], create=False)
        if not chain:
            return 0
        n, size = len(chain) * self.block_tokens, self.block_tokens
        for i, block in enumerate(chain):  # straight into the row: a concatenation first would copy it all twice
            kv.k[:, row, :, i * size : (i + 1) * size].copy_(block.k)
            kv.v[:, row, :, i * size : (i + 1) * size].copy_(block.v)
            if block.shifted is not None:
                kv.shifted[:, row, i * size : (i + 1) * size].copy_(block.shifted)
        self._touch(chain)
        self._hit_tokens += n
        return n

    @torch.inference_mode()
    def store(self, model: nn.Module, kv: KVCache, row: int, tokens: Sequence[int]) -> None:
        """Keep every whole block of `tokens`, which row `row` of `kv` holds from position 0 (blocks kept already
        are only marked as used)."""
        n_layer, _, n_kv_head, _, head_size = kv.k.shape
        per_token = 2 * n_layer * n_kv_head * head_size + (0 if kv.shifted is None else kv.shifted[:, 0, 0].numel())
        block_bytes = per_token * self.block_tokens * kv.k.element_size()
        if block_bytes > self.budget_bytes or not self._usable(model, kv, len(tokens)):
            return
        chain = self._chain(tokens, create=True, kv=kv, row=row)
        self._touch(chain)
        self._evict()

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the counts (for metrics: safe to read from another thread)."""
        return PrefixCacheStats(self._queries, self._query_tokens, self._hit_tokens, len(self._blocks), self._bytes,
                                self.budget_bytes, self._evicted)

    def clear(self) -> None:
        """Drop every block (the counts stay)."""
        self._blocks.clear()
        self._bytes = 0

    # --- inside ---------------------------------------------------------------------------------------------
    def _usable(self, model: nn.Module, kv: KVCache, length: int) -> bool:
        """Whether blocks of a sequence of `length` tokens are exact for this model (dropping every block kept for
        another model, cache layout or version of the weights)."""
        if model.training or hooked_here(model):
            return False
        if past_original_context(model.config, length):
            return False
        n_layer, _, n_kv_head, _, head_size = kv.k.shape
        owner = (weakref.ref(model), (n_layer, n_kv_head, head_size, kv.k.dtype, kv.k.device),
                 _weights_fingerprint(model))
        if owner != self._owner:
            self.clear()
            self._owner = owner
        return True

    def _chain(self, tokens: Sequence[int], *, create: bool, kv: KVCache | None = None, row: int = 0) -> list[_Block]:
        """The kept blocks that `tokens` begins with, first to last; with `create`, every whole block of `tokens`,
        copied from row `row` of `kv` where it is not kept yet."""
        chain: list[_Block] = []
        size, parent = self.block_tokens, 0
        for start in range(0, len(tokens) - size + 1, size):
            key = (parent, tuple(int(t) for t in tokens[start : start + size]))
            block = self._blocks.get(key)
            if block is None:
                if not create:
                    break
                assert kv is not None
                shifted = None if kv.shifted is None else kv.shifted[:, row, start : start + size].clone()
                block = _Block(next(self._ids), key, kv.k[:, row, :, start : start + size].clone(),
                               kv.v[:, row, :, start : start + size].clone(), shifted)
                self._blocks[key] = block
                self._bytes += block.nbytes
            chain.append(block)
            parent = block.id
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        """Most recently used, the first block last: each block stays more recent than the blocks after it."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def _evict(self) -> None:
        """Drop the least recently used blocks (leaves, see `_touch`) until the rest fit the budget."""
        if not self._blocks:
            return
        first = next(iter(self._blocks.values()))
        capacity = self.budget_bytes // first.nbytes
        while len(self._blocks) > capacity:
            _, block = self._blocks.popitem(last=False)
            self._bytes -= block.nbytes
            self._evicted += 1


def _weights_fingerprint(model: nn.Module) -> tuple:
    """What changes when a parameter or buffer is written in place (but through `.data`), replaced or moved."""
    marks = []
    for t in itertools.chain(model.parameters(), model.buffers()):
        try:
            version = t._version
        except RuntimeError:  # a tensor made under inference_mode keeps no version counter
            version = None
        marks.append((version, t.data_ptr()))
    return tuple(marks)


def restore_prompt(prefixes: PrefixCache | None, model: nn.Module, cache: KVCache, g: Generation) -> int:
    """g's prompt's longest kept prefix, copied into its row of `cache`: its length. Nothing for a row whose prompt
    logprobs need every position, or a steered one (its keys are its own)."""
    if prefixes is None or g.params.prompt_logprobs or g.steering:
        return 0
    return prefixes.restore(model, cache, g.row.slot, g.prompt_ids)


def keep_row(prefixes: PrefixCache | None, model: nn.Module, cache: KVCache, g: Generation) -> None:
    """The tokens g's row holds (its window's first `lengths` ones) kept, unless steered."""
    if prefixes is not None and not g.steering:
        held = g.row.window[: int(cache.lengths[g.row.slot])]
        prefixes.store(model, cache, g.row.slot, held)
