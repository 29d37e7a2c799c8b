"""gptlab: build, train, sample, serve and inspect GPT language models.

`GPTConfig` is plain Python; the torch-backed names load on first use, so `gptlab --help`, `gptlab prepare` and
data-loading worker processes don't pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gptlab.config import GPTConfig

if TYPE_CHECKING:
    from gptlab.model import GPT, KVCache, parameter_breakdown

__all__ = ["GPT", "GPTConfig", "KVCache", "parameter_breakdown"]
__version__ = "0.1.0"

_LAZY = {"GPT": "gptlab.model", "KVCache": "gptlab.model", "parameter_breakdown": "gptlab.model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptlab' has no attribute {name!r}")
