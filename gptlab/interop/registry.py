"""The families gptlab converts: import and export derive everything from this list.

A new family is a module (NAME, ARCHITECTURE, MODEL_TYPE, EXPRESSES, IGNORE, config_from_hf, config_to_hf,
check_export, normalize, rules; see gpt2.py) and its entry here.
"""

from __future__ import annotations

from types import ModuleType

from gptlab.interop import gpt2, llama, neox

FAMILIES: tuple[ModuleType, ...] = (gpt2, llama, neox)

BY_ARCHITECTURE = {f.ARCHITECTURE: f for f in FAMILIES}
BY_MODEL_TYPE = {f.MODEL_TYPE: f for f in FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)
