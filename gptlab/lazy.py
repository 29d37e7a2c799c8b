"""Package attributes that import their module on first use (PEP 562).

A package `__init__` lists which submodule holds each public name; the submodule is imported the first time the
name is read. So `import gptlab` (and `gptlab --help`, data-loading worker processes, the torch-free sampling
parameters) never pays for importing torch, while `from gptlab import GPT` still works.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, serving each name of `where` (name -> module) on first use:
    `__getattr__, __dir__ = lazy_exports(__name__, {"GPT": "gptlab.model"})`."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
