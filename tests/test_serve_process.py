"""`gptlab serve` as a user runs it: a process whose main thread runs the engine's loop (the thread that loaded the
model: one OpenMP team, see `gptlab.serve.scheduler`) and HTTP on a thread of its own. It answers, and Ctrl-C or
SIGTERM ends it promptly with exit 0 even while a stream is open; a port it cannot take is one line and exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")
from helpers import char_checkpoint, tiny_model  # noqa: E402

from gptlab.checkpoint import save_model  # noqa: E402
from gptlab.tokenizer import CharTokenizer  # noqa: E402

START_TIMEOUT = 120.0  # a loaded CI machine: importing torch and the app, loading the model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:  # noqa: ANN001
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,\n")
    return str(save_model(tmp_path_factory.mktemp("serve_process") / "ckpt", tiny_model(vocab_size=tok.vocab_size),
                          tok))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(checkpoint: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gptlab.cli", "serve", checkpoint, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"gptlab serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("gptlab serve did not answer in time")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_answers_and_a_signal_ends_it_cleanly(checkpoint: str, sig: int) -> None:
    port = _free_port()
    proc = _start(checkpoint, port)
    try:
        body = {"model": "ckpt", "prompt": "ab", "max_tokens": 5, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={**body, "max_tokens": 10_000, "stream": True}) as stream:  # open while it stops
            next(stream.iter_lines())
            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in proc.stderr.read()


def test_a_port_in_use_is_one_line(checkpoint: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "gptlab.cli", "serve", checkpoint, "--port", str(port)],
                             capture_output=True, text=True, timeout=START_TIMEOUT)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and str(port) in out.stderr


def test_a_run_is_served_under_its_own_name(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    """`gptlab serve runs/shakespeare` answers to model "shakespeare" (README's `gptlab serve out/run` with
    `model="run"`), not to the name of the checkpoint it picked inside the run ("best", "step-0000120")."""
    import gptlab.cli.serve as serve_cli
    from gptlab.cli import main

    run = tmp_path / "shakespeare"
    char_checkpoint(run / "checkpoints" / "best")
    monkeypatch.setattr(serve_cli, "serve_on_main_thread", lambda *a: None)  # everything but listening
    monkeypatch.setenv("GPTLAB_NO_KERNELS", "1")
    assert main(["serve", str(run), "--port", "0", "--no-ui"]) == 0
    assert "serving shakespeare on " in capsys.readouterr().out
    assert main(["serve", str(run / "checkpoints" / "best" / "model.safetensors"), "--port", "0", "--no-ui"]) == 0
    assert "serving best on " in capsys.readouterr().out  # a checkpoint given as itself keeps its own name
