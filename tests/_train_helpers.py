"""Shared by the trainer, checkpoint and eval tests: a small char-level data set and a tiny recipe."""

from __future__ import annotations

from pathlib import Path

from _paths import TINY_SHAKESPEARE

from gptlab.data import prepare

# a 2-layer, width-32 model: a training step takes a few milliseconds
TINY_RECIPE = dict(
    model="tiny",
    n_embd=32,
    n_head=2,
    n_kv_head=2,
    block_size=32,
    batch_size=8,
    max_steps=40,
    optimizer="adamw",
    lr=3e-3,
    warmup_steps=5,
    schedule="cosine",
    log_interval=5,
    eval_interval=20,
    eval_tokens=2048,
    tensorboard=False,
    threads=1,
    seed=7,
)


def make_data(root: Path, chars: int = 60_000) -> Path:
    """A char-level DATA_DIR made from the start of tiny Shakespeare (90% train / 10% val)."""
    text = root / "text.txt"
    text.write_text(TINY_SHAKESPEARE.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    out = root / "data"
    prepare([text], out, tokenizer="char")
    return out


def write_recipe(root: Path, name: str = "tiny.toml", **changes: object) -> Path:
    """TINY_RECIPE with `changes`, as a TOML file."""
    lines = []
    for key, value in {**TINY_RECIPE, **changes}.items():
        text = (
            f'"{value}"'
            if isinstance(value, str)
            else str(value).lower()
            if isinstance(value, bool)
            else value
        )
        lines.append(f"{key} = {text}")
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return path
