"""gptlab: build, train, sample, serve and inspect GPT language models."""

from gptlab.config import GPTConfig
from gptlab.model import GPT, KVCache, parameter_breakdown

__all__ = ["GPT", "GPTConfig", "KVCache", "parameter_breakdown"]
__version__ = "0.1.0"
