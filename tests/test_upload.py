"""`gptlab upload`: the files it sends (--dry-run), the model card from the run's recipe and metrics.jsonl, the
huggingface_hub calls it makes (HfApi replaced by a recorder: no network), and one-line errors without a token,
offline, and for a bad REPO_ID."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptlab import GPT, GPTConfig
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.tokenizer import CharTokenizer

TEXT = "To be, or not to be, that is the question\n"


def _run(tmp_path: Path) -> Path:
    """A run directory: a checkpoint, its recipe and three metrics rows (one torn, as a killed run leaves it)."""
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size))
    save_model(tmp_path / "run" / "checkpoints" / "step-20", model, tok)
    rows = [{"step": 10, "train_loss": 3.1, "lr": 1e-3}, {"step": 20, "train_loss": 2.5, "lr": 1e-3},
            {"step": 20, "val_loss": 2.61}]  # as the trainer logs them: the val row apart, last
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 3')
    (tmp_path / "run" / "config.resolved.json").write_text(json.dumps({  # as the trainer writes it
        "train": {"model": "tiny", "max_steps": 20, "lr": 0.001}, "model": model.config.to_dict(),
        "data": "/home/someone/data/shakespeare_char", "world_size": 1, "device": "cpu"}))
    return tmp_path / "run" / "checkpoints" / "step-20"


class RecordingApi:
    calls: list = []

    def __init__(self, token: str | None = None) -> None:
        self.calls.append(("init", token))

    def create_repo(self, repo_id: str, **kw: object) -> str:
        self.calls.append(("create_repo", repo_id, kw))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path: str, repo_id: str, **kw: object) -> None:
        folder = Path(folder_path)
        self.calls.append(("upload_folder", repo_id, sorted(p.name for p in folder.iterdir()),
                           (folder / "README.md").read_text()))


def test_dry_run_lists_the_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = _run(tmp_path)
    assert main(["upload", str(ckpt), "alice/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dry run: would upload to alice/tiny:")
    for name in ("README.md", "config.json", "model.safetensors", "tokenizer_meta.json"):
        assert name in out, out


def test_upload_calls_huggingface_hub_with_a_model_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    import huggingface_hub

    _run(tmp_path)
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    assert main(["upload", str(tmp_path / "run"), "alice/tiny", "--token", "hf_x", "--private"]) == 0
    assert "uploaded" in capsys.readouterr().out
    (_, token), (_, repo, kw), (_, repo2, files, card) = RecordingApi.calls
    assert token == "hf_x" and repo == repo2 == "alice/tiny" and kw["private"] is True and kw["exist_ok"] is True
    assert "model.safetensors" in files and ".gptlab" not in files
    # the card says what was trained on what (the recipe) and the run's metrics (the torn row skipped)
    assert "data: `shakespeare_char`" in card and "| steps | 20 |" in card
    assert "model: `tiny`" in card and "max_steps: `20`" in card and "lr: `0.001`" in card  # the recipe's settings
    assert "/home/someone" not in card and "vocab_size" not in card  # not the local path, nor the model's config
    assert "| best val loss | 2.6100 |" in card and "| last train loss | 2.5000 |" in card
    assert "LlamaForCausalLM" in card


def test_upload_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    ckpt = _run(tmp_path)
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cases = [(["upload", str(ckpt), "alice/tiny"], "no Hugging Face token"),
             (["upload", str(ckpt), "tiny"], "must be owner/name")]
    for argv, message in cases:
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["upload", str(ckpt), "alice/tiny", "--token", "hf_x"]) != 0
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err
