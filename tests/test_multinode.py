"""Two machines, played by two torchrun "nodes" on 127.0.0.1 that meet through one c10d rendezvous, as the README's
multi-node recipe runs them (one process per node, gloo): they follow one process's losses, and the run they
leave behind (in the one run directory both see: the shared filesystem) resumes in a single process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_data, run_metric, write_recipe

from gptlab.cli import main

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _losses(run: Path) -> list[float]:
    return run_metric(run, "train_loss")


def _start_nodes(recipe: Path, data: Path, run: Path, stdout: int) -> list[subprocess.Popen]:
    """Two torchrun "machines" of one process each on 127.0.0.1, meeting through one c10d rendezvous."""
    port, env = _free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}",
         "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=gptlab-test", "-m", "gptlab.cli",
         "train", str(recipe), "--data", str(data), "--out", str(run), "--quiet"],
        cwd=REPO, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]


def test_two_nodes_follow_one_process_and_their_run_resumes_in_one(tmp_path: Path) -> None:
    data = make_data(tmp_path)
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, log_interval=5, checkpoint_interval=10)
    run = tmp_path / "nodes"
    nodes = _start_nodes(recipe, data, run, subprocess.PIPE)
    try:
        outs = [n.communicate(timeout=180) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert all(n.returncode == 0 for n in nodes), [err[-1500:] for _, err in outs]
    one = tmp_path / "one"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(one), "--quiet", "--grad-accum", "2"]) == 0
    assert _losses(run) == pytest.approx(_losses(one), abs=1e-4)
    # the two nodes' run goes on in one process (its whole batch in one micro-step), as the single process's does
    more = ["--max-steps", "15", "--resume", "--quiet"]
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), *more]) == 0
    assert main(["train", str(recipe), "--data", str(data), "--out", str(one), "--grad-accum", "2", *more]) == 0
    assert _losses(run) == pytest.approx(_losses(one), abs=1e-4) and len(_losses(run)) == 3


def test_when_one_node_dies_the_other_stops_too(tmp_path: Path) -> None:
    """A machine lost mid-run (its torchrun killed): the other waits in its next collective until
    `distributed_timeout` (gloo and NCCL alike would otherwise wait torch's default, 10-30 minutes), or until gloo
    sees the peer's socket close, then its torchrun exits non-zero with a one-line error; the run's checkpoints are
    intact for --resume."""
    import time

    data = make_data(tmp_path)
    recipe = write_recipe(tmp_path, max_steps=100_000, eval_interval=0, log_interval=5, checkpoint_interval=20,
                          distributed_timeout=5)
    run = tmp_path / "nodes"
    nodes = _start_nodes(recipe, data, run, subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list((run / "checkpoints").glob("step-*")), "no checkpoint within 120 s"
        for pid in [*_descendants(nodes[1].pid), nodes[1].pid]:  # machine 1 is gone: its torchrun and its trainer
            os.kill(pid, 9)
        t0 = time.monotonic()
        _, err = nodes[0].communicate(timeout=120)
        assert nodes[0].returncode != 0 and time.monotonic() - t0 < 90
        # one line saying what happened, not an "internal error" (a bug) in gloo's words
        assert "error: process 0 of 2: another process of this run ended or stopped answering (" in err, err[-2000:]
        assert "internal error" not in err
    finally:
        for n in nodes:
            n.kill()
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet", "--resume",
                 "--max-steps", "25"]) == 0
