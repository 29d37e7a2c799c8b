"""The KV cache: keys and values of every layer for incremental decoding, and what a cached forward needs to know.

The model asks the cache three things, in this order, for each forward over T new tokens per row:

    pos, masks = cache.begin(T)         # where the new tokens sit, and which cached keys each may see
    k, v = cache.append(layer, k, v)    # in each layer: store the new keys/values, get everything cached so far
    cache.advance(T)                    # after the last layer: the rows now hold T more tokens

Rows are independent: row b's next tokens go to positions lengths[b], lengths[b] + 1, ...; a row can be rewound
or restarted by setting its length (stale entries beyond it are never attended to). A new position scheme or
attention pattern (ALiBi, a new window) changes `begin`'s positions and masks here, and nothing in the engine.

Sliding-window layers (Mistral, Gemma 2's local layers) keep every key too; their mask hides those more than
`sliding_window` positions back, so prefill, decoding and decoding past the window all see what a whole forward
sees.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from gptlab.config import GPTConfig
from gptlab.token_shift import previous_in_sequence, zeros_at_starts


class Masks(NamedTuple):
    """Boolean attention masks (B or 1, 1, T, keys) for one forward; None where plain causal attention is exact."""

    full: torch.Tensor | None  # for layers that see every earlier position
    window: torch.Tensor | None  # for sliding-window layers


def causal_mask(pos: torch.Tensor, n_keys: int, window: int | None = None) -> torch.Tensor:
    """Queries at positions `pos` (1 or B, T) see keys 0..n_keys-1 at or before them, and within the last
    `window` positions (itself included) when set: (B or 1, 1, T, n_keys)."""
    keys = torch.arange(n_keys, device=pos.device)[None, None, None, :]
    q = pos[:, None, :, None]
    mask = keys <= q
    return mask if window is None else mask & (keys > q - window)


def masks_for(pos: torch.Tensor, n_keys: int, full: torch.Tensor | None, window: int | None) -> Masks:
    """Both masks from the full one: the window's is needed only once some query is `window` or more positions
    past key 0."""
    if window is None or n_keys <= window:
        return Masks(full, full)
    return Masks(full, causal_mask(pos, n_keys, window))


def document_ids(x: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Which document of its row each token is in: the count of end-of-text tokens before it (an end-of-text
    belongs to the document it ends)."""
    ends = (x == eot_id).to(torch.int32)
    return ends.cumsum(dim=1) - ends


def document_masks(documents: torch.Tensor, window: int | None) -> tuple[torch.Tensor, Masks]:
    """Packed documents (a (B, T) id per token: which document of its row it belongs to) attended to one by one:
    each token sees only the earlier tokens of its own document (block-diagonal and causal), and its position
    counts from its document's start, so every document is computed as if it ran alone. (B, T) positions and
    the masks."""
    B, T = documents.shape
    index = torch.arange(T, device=documents.device).expand(B, T)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    pos = index - torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    same = documents[:, None, :, None] == documents[:, None, None, :]
    full = causal_mask(index, T) & same
    return pos, Masks(full, full if window is None else causal_mask(index, T, window) & same)


class KVCache:
    """Keys and values of every layer, allocated once, plus the number of tokens each row holds.

    `dtype` is how they are stored, `attend_dtype` (default: the same) the dtype `append` hands them to attention
    in: a bf16 model's keys and values stored in bf16 (exactly: they are bf16 values) and attended in fp32, as in an
    fp32 cache, from half the memory."""

    def __init__(
        self,
        config: GPTConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        attend_dtype: torch.dtype | None = None,
    ) -> None:
        self.max_len = max_len or config.block_size
        self.attend_dtype = attend_dtype or dtype
        shape = cache_shape(config, batch_size, self.max_len)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (n_layer, B, nkv, max_len, hs)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        # a token-shift model's shifted vectors at every position (`gptlab.token_shift`), as keys are kept
        shifted = shifted_shape(config, batch_size, self.max_len)
        self.shifted = None if shifted is None else torch.zeros(shifted, device=device, dtype=dtype)
        self._where: int | tuple[torch.Tensor, torch.Tensor] = 0  # set by begin(): where this step writes
        self._end = 0  # set by begin(): keys 0..end-1 are attended over in this step

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def reset(self) -> None:
        self.lengths.zero_()

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows start..stop-1 as a cache of their own that shares this one's storage (no copy).

        A forward through it reads and writes those rows only, e.g. to prefill a new request's row while other
        rows are mid-generation. All the rows: the cache itself (a batch-1 step's every call sliced it)."""
        if start == 0 and stop >= self.batch_size:
            return self
        view = object.__new__(KVCache)
        view.max_len, view.attend_dtype = self.max_len, self.attend_dtype
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths = self.lengths[start:stop]  # a view: advance()'s in-place `+=` updates this cache too
        view.shifted = None if self.shifted is None else self.shifted[:, start:stop]
        view._where, view._end = 0, 0
        return view

    def gather(self, slots: torch.Tensor, max_len: int) -> KVCache:
        """Rows `slots` (any rows, in this order) copied into a cache of their own of `max_len` positions: their
        lengths and the keys and values up to the longest one (the rest zero, never NaN: a masked key's value
        still enters attention's sum with weight 0). `scatter` writes back what a forward added."""
        part = object.__new__(KVCache)
        part.max_len, part.attend_dtype = max_len, self.attend_dtype
        part.lengths = self.lengths[slots].clone()
        held = int(part.lengths.max())
        shape = (self.k.shape[0], len(slots), self.k.shape[2], max_len, self.k.shape[4])
        part.k, part.v = self.k.new_zeros(shape), self.v.new_zeros(shape)
        part.shifted = None
        if self.shifted is not None:
            part.shifted = self.shifted.new_zeros(self.shifted.shape[0], len(slots), max_len, self.shifted.shape[3])
        if held:
            part.k[:, :, :, :held] = self.k[:, slots, :, :held]
            part.v[:, :, :, :held] = self.v[:, slots, :, :held]
            if part.shifted is not None:
                part.shifted[:, :, :held] = self.shifted[:, slots, :held]
        part._where, part._end = 0, 0
        return part

    def scatter(self, slots: torch.Tensor, part: KVCache, start: int, stop: int) -> None:
        """Write positions start..stop-1 of `part` (made by `gather(slots, ...)`) back into rows `slots`."""
        self.k[:, slots, :, start:stop] = part.k[:, :, :, start:stop]
        self.v[:, slots, :, start:stop] = part.v[:, :, :, start:stop]
        if self.shifted is not None:
            self.shifted[:, slots, start:stop] = part.shifted[:, :, start:stop]

    # --- one cached forward: begin, append per layer, advance ----------------------------------------------------
    def begin(self, T: int, sliding_window: int | None = None, keys: int | None = None) -> tuple[torch.Tensor, Masks]:
        """Plan a forward of T new tokens per row: their positions (1 or B, T), and the boolean attention masks
        (B or 1, 1, T, keys) of full and sliding-window layers, None where plain causal attention (or "see every
        key") is exact.

        With `keys` (the caller's bound: every row holds at most keys - T tokens) nothing is read back from the
        device and every shape depends on (B, T, keys) alone: positions come from the lengths on the device, each
        row writes at its own, and attention runs over `keys` keys under a mask. What a CUDA graph can capture."""
        # without `keys`, the rows' shortest and longest lengths (read back): rows of one length share positions
        lo, hi = (int(n) for n in torch.aminmax(self.lengths)) if keys is None else (None, None)
        end = hi + T if keys is None else keys
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens per row; this step needs {end}")
        device = self.lengths.device
        shared = keys is None and lo == hi
        if shared:  # fast path: every row at the same length shares positions, and writes are slices
            pos = torch.arange(lo, end, device=device)[None]  # (1, T)
            self._where = lo
        else:
            pos = self.lengths[:, None] + torch.arange(T, device=device)  # (B, T): each row's own
            self._where = (torch.arange(self.batch_size, device=device)[:, None], pos)
        self._end = end
        # query at position p sees cached keys at positions <= p (stale entries past a row's end never qualify).
        # No mask is needed when rows share a length and either one token is added (it sees every key) or the
        # cache was empty (plain causal).
        mask = causal_mask(pos, end) if not shared or (T > 1 and lo > 0) else None  # (B or 1, 1, T, end)
        return pos, masks_for(pos, end, mask, sliding_window)

    def begin_rows(self, slots: torch.Tensor, pos: torch.Tensor, sliding_window: int | None = None) -> Masks:
        """Plan a step of one token per row i at position pos[i] of cache row slots[i] (R each): rows of one slot
        at successive positions are a prompt's next tokens beside other rows' new ones. Returns the masks (R, 1, 1,
        keys): each row sees its slot's keys up to its own position. For steps that write the cache themselves
        (`step_target`: the C++ step); the caller moves `lengths` on."""
        end = int(pos.max()) + 1
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens per row; this step needs {end}")
        self._where, self._end = (slots[:, None], pos[:, None]), end
        return masks_for(pos[:, None], end, causal_mask(pos[:, None], end), sliding_window)

    def step_target(self) -> tuple[int | tuple[torch.Tensor, torch.Tensor], int]:
        """Where the step `begin` planned writes its keys (a position every row shares, or (rows (B, 1), positions
        (B, T)) of each row's own), and how many keys it attends over: for steps that write the cache themselves."""
        return self._where, self._end

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s new keys and values (B, nkv, T, hs) at the positions `begin` planned; return
        the layer's keys and values so far (B, nkv, end, hs), in `attend_dtype`."""
        k_buf, v_buf = self.k[layer], self.v[layer]  # (B, nkv, max_len, hs)
        T = k.shape[2]
        if isinstance(self._where, int):  # every row writes at the same positions: a plain slice copy
            k_buf[:, :, self._where : self._where + T] = k
            v_buf[:, :, self._where : self._where + T] = v
        else:  # row b writes at its positions pos[b] (index_put: bf16 scatter_ copies the whole buffer)
            rows, pos = self._where  # (B, 1), (B, T)
            k_buf[rows, :, pos] = k.transpose(1, 2).to(k_buf.dtype)  # the indexed view is (B, T, nkv, hs)
            v_buf[rows, :, pos] = v.transpose(1, 2).to(v_buf.dtype)
        k, v = k_buf[:, :, : self._end], v_buf[:, :, : self._end]
        return k.to(self.attend_dtype), v.to(self.attend_dtype)  # (no copy where they are the same)

    def previous(self, point: int, h: torch.Tensor) -> torch.Tensor:
        """Keep shift point `point`'s new vectors h (B, T, C) at the positions `begin` planned, and return the
        vectors at the positions before them (B, T, C): a row's own from earlier steps or this one, zeros at
        position 0. For a `token_shift` model (`gptlab.token_shift`)."""
        if self.shifted is None:
            raise ValueError("this KV cache keeps no shifted vectors: it was made for a config without token_shift")
        buf, T = self.shifted[point], h.shape[1]  # (B, max_len, C)
        if isinstance(self._where, int):  # every row writes at the same positions
            start = self._where
            buf[:, start : start + T] = h
            if start:
                return buf[:, start - 1 : start + T - 1].to(h.dtype)
            return previous_in_sequence(h)
        rows, pos = self._where  # (B, 1), (B, T)
        buf[rows, pos] = h.to(buf.dtype)
        return zeros_at_starts(buf[rows, (pos - 1).clamp(min=0)].to(h.dtype), pos)  # (B, T, C)

    def advance(self, T: int) -> None:
        """Every row now holds T more tokens (after the forward's last layer)."""
        self.lengths += T


def cache_shape(config: GPTConfig, batch_size: int, max_len: int) -> tuple[int, int, int, int, int]:
    """The shape of a KVCache's keys (and of its values): (n_layer, B, nkv, max_len, hs)."""
    return (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_size)


def shifted_shape(config: GPTConfig, batch_size: int, max_len: int) -> tuple[int, int, int, int] | None:
    """The shape of a KVCache's shifted vectors, (shift points, B, max_len, C): the embeddings' and each layer's
    MLP input; None for a model without token shift."""
    return (config.n_layer + 1, batch_size, max_len, config.n_embd) if config.token_shift else None


def cache_bytes(config: GPTConfig, batch_size: int, max_len: int, dtype: torch.dtype) -> int:
    """What a KVCache of this shape allocates: keys and values of every layer (and a token-shift model's shifted
    vectors)."""
    shifted = shifted_shape(config, batch_size, max_len)
    elements = 2 * math.prod(cache_shape(config, batch_size, max_len)) + (0 if shifted is None else math.prod(shifted))
    return elements * torch.empty((), dtype=dtype).element_size()


def default_cache_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """fp32 keys/values on CPUs whatever the weights' dtype, else the weights' dtype.

    Attention runs in the cache's dtype when it is the wider one. On CPUs PyTorch's bf16 attention kernels are
    slower than fp32 ones at decoding shapes, even though they read half the bytes; fp32 is also the more accurate
    choice."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype


def cache_length(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Cache rows long enough for these prompts and continuations (the engine caps it at block_size).

    Allocating (and zeroing) only what a run can use keeps one-shot calls cheap: a full GPT-2 cache of 1024
    positions is 75 MB per row in fp32."""
    # at least one position past the prompt: a row's check wants room for one token even when none is asked for
    return max((len(p) for p in prompts), default=1) + max(max_new_tokens, 1)
