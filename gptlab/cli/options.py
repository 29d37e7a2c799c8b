"""Flags several commands share, and turning them into the library's types."""

from __future__ import annotations

import argparse
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")


def add_dtype(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=help)


def torch_dtype(name: str) -> Any:
    """The torch dtype named by a --dtype flag (one of DTYPES: argparse has checked it)."""
    import torch

    return getattr(torch, name)
