"""gptlab: build, train, sample, serve and inspect GPT language models.

The public API, in one place:

    from gptlab import GPT, GPTConfig, generate, from_hf, save_hf, load_model, save_model

`GPTConfig` is plain Python; the torch-backed names load on first use, so `gptlab --help`, `gptlab prepare` and
data-loading worker processes don't pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptlab.config import GPTConfig
from gptlab.lazy import lazy_exports

if TYPE_CHECKING:
    from gptlab.checkpoint import save_model
    from gptlab.flops import parameter_breakdown
    from gptlab.generation import SamplingParams, generate, generate_batch, generate_stream
    from gptlab.hooks import run_with_cache, run_with_hooks
    from gptlab.interop import from_hf, save_hf
    from gptlab.kv_cache import KVCache
    from gptlab.loading import load_model
    from gptlab.model import GPT
    from gptlab.quantize import quantize_model

__version__ = "0.1.0"

_LAZY = {
    "GPT": "gptlab.model",
    "parameter_breakdown": "gptlab.flops",
    "KVCache": "gptlab.kv_cache",
    "generate": "gptlab.generation",  # idx (B, T) -> (B, T + new), as nanoGPT's model.generate
    "generate_batch": "gptlab.generation",
    "generate_stream": "gptlab.generation",
    "SamplingParams": "gptlab.generation",
    "from_hf": "gptlab.interop",
    "save_hf": "gptlab.interop",
    "load_model": "gptlab.loading",  # a run, checkpoint or Hugging Face directory -> (model, tokenizer)
    "save_model": "gptlab.checkpoint",
    "quantize_model": "gptlab.quantize",  # weight-only int8 / int4 Linear layers for inference, in place
    "run_with_cache": "gptlab.hooks",  # (logits, {hook point name: activation}) of one forward
    "run_with_hooks": "gptlab.hooks",  # logits of one forward with functions reading / replacing activations
}
__all__ = ["GPT", "GPTConfig", "KVCache", "SamplingParams", "from_hf", "generate", "generate_batch", "generate_stream",
           "load_model", "parameter_breakdown", "quantize_model", "run_with_cache", "run_with_hooks", "save_hf",
           "save_model"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
