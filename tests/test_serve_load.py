"""The serving benchmark's peer figures: llama.cpp's engine alone at the served batch is read from
`llama-batched-bench`'s generation column (benchmarks/serve_load.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("httptools")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# llama-batched-bench's table as it prints it (llama.cpp b6xxx), one batch size
TABLE = """\
llama_batched_bench: n_kv_max = 2304, n_batch = 2048, n_ubatch = 512, flash_attn = -1, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |     64 |   16 |   1152 |    0.022 |  5853.84 |    0.271 |  3777.04 |    0.293 |  3932.04 |
"""


def test_the_peers_offline_figure_is_the_generation_column_at_the_served_batch(tmp_path: Path) -> None:
    bench, argv = tmp_path / "llama-batched-bench", tmp_path / "argv"
    table = tmp_path / "table.txt"
    table.write_text(TABLE)
    bench.write_text(f"#!/bin/sh\necho \"$@\" > {argv}\ncat {table}\n")
    bench.chmod(0o755)
    # in a process of its own: serve_load imports its sibling scripts from benchmarks/ as top-level modules
    code = ("import argparse, sys; from pathlib import Path; import serve_load; "
            f"print(serve_load.llama_offline_tokens_per_s(Path({str(bench)!r}), Path('m.gguf'), 128, "
            "argparse.Namespace(max_tokens=64, max_batch=16, threads=2)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True, check=True)
    assert float(done.stdout.split()[-1]) == 3777.04  # S_TG, not S_PP or S
    args = argv.read_text().split()
    assert args[args.index("-npl") + 1] == "16" and args[args.index("-ntg") + 1] == "64"
    assert args[args.index("--ctx-size") + 1] == str(128 * 16)  # room for every sequence
