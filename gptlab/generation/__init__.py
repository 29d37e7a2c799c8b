"""Text generation: sampling settings, the batched KV-cached engine, and one-call helpers over it.

One module per job, each importing only those below it:

    params         SamplingParams, InvalidSamplingParam, MAX_LOGPROBS  (no torch: the server's schemas use it)
    sampling       the logit filters, sample_next, token log-probabilities
    grammar        structured outputs: a row's JSON schema as an llguidance grammar, a batch's token masks
    detokenize     token ids -> streamed text (whole characters, stop strings held back)
    packed_linear  CPU-friendly weight layouts for the engine's forwards
    rows           Generation, PromptTooLongError: one prompt checked, and its row's state as it decodes
    speculative    speculative decoding: drafters (a draft model, prompt lookup: NgramDrafter), the accept/reject rule
    engine         Engine: continuous batching over one preallocated KV cache
    api            generate, generate_batch, generate_stream, stream_deltas
    chat           ChatSession: a conversation kept to the context, its replies streamed (`gptlab chat`)
    tool_calls     a reply that may call tools: its grammar by tool_choice, generate_tool_reply

The names below load on first use, so `import gptlab.generation.params` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptlab.lazy import lazy_exports

if TYPE_CHECKING:
    from gptlab.generation.api import generate, generate_batch, generate_stream, stream_deltas
    from gptlab.generation.chat import ChatSession, MessageTooLongError
    from gptlab.generation.detokenize import TextState
    from gptlab.generation.engine import Engine
    from gptlab.generation.params import MAX_LOGPROBS, InvalidSamplingParam, SamplingParams
    from gptlab.generation.prefix_cache import PrefixCache, PrefixCacheStats
    from gptlab.generation.request import Generation, PromptTooLongError
    from gptlab.generation.sampling import TokenLogprob, sample_next
    from gptlab.generation.speculative import NgramDrafter
    from gptlab.generation.tool_calls import generate_tool_reply
    from gptlab.kv_cache import cache_length, default_cache_dtype

_LAZY = {
    "SamplingParams": "gptlab.generation.params",
    "InvalidSamplingParam": "gptlab.generation.params",
    "MAX_LOGPROBS": "gptlab.generation.params",
    "TokenLogprob": "gptlab.generation.sampling",
    "sample_next": "gptlab.generation.sampling",
    "TextState": "gptlab.generation.detokenize",
    "Engine": "gptlab.generation.engine",
    "Generation": "gptlab.generation.request",
    "PromptTooLongError": "gptlab.generation.request",
    "cache_length": "gptlab.kv_cache",
    "default_cache_dtype": "gptlab.kv_cache",
    "generate": "gptlab.generation.api",  # idx (B, T) -> (B, T + new), as nanoGPT's model.generate
    "generate_batch": "gptlab.generation.api",
    "generate_stream": "gptlab.generation.api",
    "stream_deltas": "gptlab.generation.api",
    "ChatSession": "gptlab.generation.chat",
    "MessageTooLongError": "gptlab.generation.chat",
    "PrefixCache": "gptlab.generation.prefix_cache",
    "PrefixCacheStats": "gptlab.generation.prefix_cache",
    "generate_tool_reply": "gptlab.generation.tool_calls",
    "NgramDrafter": "gptlab.generation.speculative",
}
__all__ = [  # = _LAZY's names, spelled out so that tools see what is exported
    "SamplingParams", "InvalidSamplingParam", "MAX_LOGPROBS", "TokenLogprob", "sample_next", "TextState", "Engine",
    "Generation", "PromptTooLongError", "cache_length", "default_cache_dtype", "generate", "generate_batch",
    "generate_stream", "stream_deltas", "ChatSession", "MessageTooLongError", "PrefixCache", "PrefixCacheStats",
    "generate_tool_reply", "NgramDrafter",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
