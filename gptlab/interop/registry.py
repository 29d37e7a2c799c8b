"""The families gptlab converts: import and export derive everything from this list.

A new family is a module (NAME, ARCHITECTURE, MODEL_TYPE, EXPRESSES, IGNORE, config_from_hf, config_to_hf,
check_export, normalize, rules; see gpt2.py) and its entry here.
"""

from __future__ import annotations

from types import ModuleType

from gptlab.interop import gemma2, gpt2, gptj, llama, mistral, neox, phi3, qwen2, qwen3

FAMILIES: tuple[ModuleType, ...] = (gpt2, llama, neox, qwen2, qwen3, mistral, gemma2, phi3, gptj)

BY_ARCHITECTURE = {f.ARCHITECTURE: f for f in FAMILIES}
BY_MODEL_TYPE = {f.MODEL_TYPE: f for f in FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)
