"""`gptlab.interop.hub` and `gptlab download`, without the network: huggingface_hub's `model_info` and
`snapshot_download` are replaced by a fake repository (its files in memory), or raise what the Hub would."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from helpers import REPO, one_line_error
from huggingface_hub import errors

from gptlab.cli import main
from gptlab.interop.hub import HubError, default_directory, download_model, select_files

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SUPPORT = {
    "config.json": b'{"model_type": "llama"}',
    "generation_config.json": b"{}",
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "special_tokens_map.json": b"{}",
    "chat_template.jinja": b"{{ messages }}",
}
NOISE = {  # never downloaded
    "README.md": b"# a model",
    ".gitattributes": b"*.bin filter=lfs",
    "pytorch_model.bin": b"pickle!",
    "tf_model.h5": b"hdf5",
    "onnx/model.onnx": b"onnx",
    "onnx/model.safetensors": b"not at the top level",
    "original/consolidated.00.pth": b"pickle!",
}


class FakeHub:
    """A repository of `files` behind fake `model_info` and `snapshot_download`; `calls` records them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, files: dict[str, bytes], corrupt: str | None = None):
        self.files, self.corrupt, self.calls = files, corrupt, []
        monkeypatch.setattr(huggingface_hub, "model_info", self.model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def model_info(self, repo_id, *, revision=None, files_metadata=False, **_):
        self.calls.append(("model_info", repo_id, revision))

        def lfs(name, content):  # what the Hub lists for large files: their sha256
            if name.endswith((".safetensors", ".bin", ".pth")):
                return SimpleNamespace(sha256=hashlib.sha256(content).hexdigest(), size=len(content))
            return None

        siblings = [SimpleNamespace(rfilename=n, lfs=lfs(n, c) if files_metadata else None)
                    for n, c in self.files.items()]
        return SimpleNamespace(sha=COMMIT, siblings=siblings)

    def snapshot_download(self, repo_id, *, revision=None, local_dir=None, allow_patterns=None, **_):
        assert revision == COMMIT, "every file comes from the commit model_info saw"
        names = sorted(n for n in self.files if any(fnmatch.fnmatchcase(n, p) for p in allow_patterns))
        self.calls.append(("snapshot_download", names))
        for name in names:
            path = Path(local_dir) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"garbage" if name == self.corrupt else self.files[name])
        return str(local_dir)


def raising(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc

    return fail


def hub_error(cls: type, status: int | None = None) -> BaseException:
    """An instance of one of huggingface_hub's HTTP errors (their constructors want a live response)."""
    e = cls.__new__(cls, f"{status} Client Error")
    e.response = SimpleNamespace(status_code=status)
    return e


def test_only_the_files_gptlab_reads_are_downloaded(monkeypatch, tmp_path, capsys):
    weights = {"model.safetensors": b"weights"}
    hub = FakeHub(monkeypatch, {**SUPPORT, **NOISE, **weights})
    monkeypatch.chdir(tmp_path)
    done = download_model("someone/tiny-llama")
    assert done.directory == Path("models/tiny-llama") == default_directory("someone/tiny-llama")
    assert sorted(done.files) == sorted([*SUPPORT, *weights]) and done.revision == COMMIT
    on_disk = sorted(str(p.relative_to(done.directory)) for p in done.directory.rglob("*") if p.is_file())
    assert on_disk == sorted(done.files)
    assert hub.calls[0] == ("model_info", "someone/tiny-llama", None)
    assert [c[0] for c in hub.calls] == ["model_info", "snapshot_download"]

    assert main(["download", "someone/tiny-llama", "--out", "elsewhere", "--revision", "v1"]) == 0
    out = capsys.readouterr().out.splitlines()
    size = sum(map(len, SUPPORT.values())) + len(weights["model.safetensors"])
    assert out[0] == f"downloaded someone/tiny-llama (commit {COMMIT[:12]}) to elsewhere: 7 files, {size} bytes"
    assert out[1].startswith("next: gptlab chat elsewhere")
    assert hub.calls[-2] == ("model_info", "someone/tiny-llama", "v1")


def test_sharded_weights_come_from_the_index(monkeypatch, tmp_path):
    shards = {"model-00001-of-00002.safetensors": b"one", "model-00002-of-00002.safetensors": b"two"}
    index = {"weight_map": dict(zip(["a.weight", "b.weight"], shards, strict=True))}
    files = {**SUPPORT, "model.safetensors.index.json": json.dumps(index).encode(), **shards,
             "consolidated.safetensors": b"the same weights in another layout"}
    hub = FakeHub(monkeypatch, files)
    done = download_model("someone/sharded", out=tmp_path / "m")
    assert sorted(done.files) == sorted([*SUPPORT, "model.safetensors.index.json", *shards])
    assert hub.calls[-1] == ("snapshot_download", sorted(shards))
    # a single file beats the index (gptlab loads it first); without either, every top-level .safetensors
    assert sorted(select_files("r", [*files, "model.safetensors"])[0]) == sorted([*SUPPORT, "model.safetensors"])
    assert select_files("r", ["config.json", "x.safetensors", "y.safetensors"]) == (
        ["config.json", "x.safetensors", "y.safetensors"], "all")


def test_a_repository_with_only_pickle_weights_is_refused(monkeypatch, tmp_path, capsys):
    hub = FakeHub(monkeypatch, {**SUPPORT, "pytorch_model.bin": b"pickle!", "README.md": b"hi"})
    with pytest.raises(HubError, match="only pickle weights .pytorch_model.bin. and gptlab never unpickles"):
        download_model("someone/old-model", out=tmp_path / "m")
    assert [c[0] for c in hub.calls] == ["model_info"] and not (tmp_path / "m").exists()
    assert main(["download", "someone/old-model", "--out", str(tmp_path / "m")]) == 2
    assert "safetensors" in one_line_error(2, capsys.readouterr().err)
    FakeHub(monkeypatch, {**SUPPORT, "README.md": b"hi"})
    with pytest.raises(HubError, match="no model weights"):
        download_model("someone/no-weights", out=tmp_path / "n")


def test_a_corrupted_weight_file_is_deleted(monkeypatch, tmp_path):
    FakeHub(monkeypatch, {**SUPPORT, "model.safetensors": b"weights"}, corrupt="model.safetensors")
    with pytest.raises(HubError, match="does not match the sha256"):
        download_model("someone/tiny", out=tmp_path / "m")
    assert not (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "config.json").exists()


class ConnectError(Exception):
    """Stands for httpx's / httpx2's ConnectError (matched by class name, whichever library raised it)."""


@pytest.mark.parametrize("where, exc, message", [
    ("model_info", ConnectError("[Errno -2] Name or service not known"), "cannot reach the Hugging Face Hub"),
    ("model_info", ConnectionError("refused"), "cannot reach the Hugging Face Hub"),
    ("snapshot_download", errors.LocalEntryNotFoundError("check your internet connection"),
     "cannot reach the Hugging Face Hub"),
    ("model_info", hub_error(errors.RepositoryNotFoundError, 404), "no model repository someone/tiny"),
    ("model_info", hub_error(errors.RevisionNotFoundError, 404), "has no revision"),
    ("snapshot_download", hub_error(errors.GatedRepoError, 403), "is gated: accept its terms"),
    ("model_info", hub_error(errors.HfHubHTTPError, 401), "refused access to someone/tiny (HTTP 401)"),
    ("model_info", errors.OfflineModeIsEnabled("offline"), "pass its local directory"),
    ("snapshot_download", OSError(28, "No space left on device"), "cannot write the download"),
])
def test_hub_failures_are_one_line(monkeypatch, tmp_path, capsys, where, exc, message):
    FakeHub(monkeypatch, {**SUPPORT, "model.safetensors": b"w"})
    monkeypatch.setattr(huggingface_hub, where, raising(exc))
    assert main(["download", "someone/tiny", "--out", str(tmp_path / "m")]) == 2
    line = one_line_error(2, capsys.readouterr().err)
    assert message in line
    if "reach" in message:
        assert "local directory" in line


def test_offline_mode_asks_for_a_local_directory(monkeypatch, tmp_path):
    hub = FakeHub(monkeypatch, {**SUPPORT, "model.safetensors": b"w"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set.*pass its local directory to gptlab instead"):
        download_model("someone/tiny", out=tmp_path / "m")
    assert hub.calls == []  # not even a request
    # the real huggingface_hub, in a fresh process: nothing is patched and nothing reaches the network
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "gptlab.cli", "download", "openai-community/gpt2", "--out",
                           str(tmp_path / "gpt2")], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert "local directory" in one_line_error(proc.returncode, proc.stderr)
    assert not (tmp_path / "gpt2").exists()


def test_interop_serves_its_names_on_first_use_and_download_needs_no_torch():
    """gptlab.interop's names import their module when read; `gptlab download`'s module imports without torch."""
    import subprocess
    import sys

    import gptlab.interop as interop

    assert interop.__all__ == list(interop._LAZY)
    assert all(getattr(interop, name) is not None for name in interop.__all__)
    code = "import sys, gptlab.interop.hub; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
