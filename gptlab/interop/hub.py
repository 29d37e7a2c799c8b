"""Download a model from the Hugging Face Hub: only the files gptlab reads, and never a pickle.

A Hub repository often holds the same weights several times (safetensors, pytorch_model.bin, TensorFlow, Flax,
ONNX, GGUF, an `original/` folder of .pth files) next to READMEs and images. `download_model` lists the
repository once, pins the commit it saw (so every file comes from the same revision), and fetches only what a
Hugging Face directory needs in `gptlab.loading`: the JSON configs, the tokenizer files, the chat template and
the safetensors weights at the top level (`model.safetensors`; else the shards `model.safetensors.index.json`
names; else every `*.safetensors`). A repository whose only weights are pickles (.bin, .pt, .pth, .ckpt, .pkl)
is refused before anything is downloaded: unpickling a file can run any code its author wrote, and gptlab never
unpickles what it downloads.

Integrity: huggingface_hub checks each file it downloads against the Hub's metadata (its size over HTTP; Xet
transfers are content-addressed, by chunk hashes), but over HTTP it does not hash what it received. The Hub lists
the sha256 of every large (LFS) file, the weights among them, so `download_model` hashes each one it fetched and
compares (`verify=True`): a mismatch deletes the file, so that a second run downloads it again, and raises.
Files already in the output directory and unchanged on the Hub are not downloaded again (huggingface_hub keeps
their metadata in `DIR/.cache/huggingface`).

Every failure is one `HubError` line that says what to do: offline mode (`HF_HUB_OFFLINE`, checked before any
request), no connection (both: download elsewhere and pass the local directory instead), repository or revision
not found, gated or private repositories (log in), other HTTP errors, a full disk.

This module imports huggingface_hub (not torch): `gptlab download` needs nothing else.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError
from gptlab.fileio import read_json_object

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# everything but the weights that a Hugging Face model directory may need (configs, tokenizer, chat template)
SUPPORT_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", SAFETENSORS_INDEX,
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
DEFAULT_ROOT = Path("models")  # the default output is models/<repository name>, in the working directory
_OFFLINE_VALUES = {"1", "on", "yes", "true"}
# transport failures of requests, httpx and httpx2 (huggingface_hub's HTTP client across versions), by class name
_NETWORK_ERRORS = {"ConnectionError", "ConnectError", "ConnectTimeout", "Timeout", "TimeoutException",
                   "NetworkError", "TransportError", "ProxyError", "SSLError", "ReadTimeout"}
_CHUNK = 1 << 24  # bytes hashed at a time


class HubError(GptlabError):
    """A download that cannot go ahead, with a message that says what to do instead."""


@dataclass(frozen=True)
class Download:
    """A finished download: the model directory, the commit its files come from, and what was fetched."""

    repo_id: str
    revision: str
    directory: Path
    files: tuple[str, ...]
    size: int  # bytes of `files`


def default_directory(repo_id: str) -> Path:
    """models/<name> for the repository <owner>/<name>."""
    return DEFAULT_ROOT / repo_id.rstrip("/").split("/")[-1]


def offline() -> bool:
    """Whether huggingface_hub's offline mode is on (HF_HUB_OFFLINE, read now rather than at its import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _OFFLINE_VALUES or bool(constants.HF_HUB_OFFLINE)


def select_files(repo_id: str, files: Iterable[str]) -> tuple[list[str], str]:
    """(the files to download, how the weights are found) from a repository's file list: the support files
    present, and the safetensors weights at the top level (`weights` is "single", "index" (the shards come from
    the index) or "all"). Raises HubError for a repository with only pickle weights, or with none."""
    top = sorted(f for f in files if "/" not in f)
    support = [f for f in top if f in SUPPORT_FILES]
    if SAFETENSORS_FILE in top:  # gptlab loads it before an index: the shards would be dead weight
        return [f for f in support if f != SAFETENSORS_INDEX] + [SAFETENSORS_FILE], "single"
    if SAFETENSORS_INDEX in top:
        return support, "index"
    weights = [f for f in top if f.endswith(".safetensors")]
    if weights:
        return support + weights, "all"
    pickles = [f for f in sorted(files) if f.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
        raise HubError(
            f"{repo_id} has only pickle weights ({shown}) and gptlab never unpickles downloads (a pickle can run "
            "any code): try a revision with .safetensors weights (the Hub's conversion bot often has one as a pull "
            "request: --revision refs/pr/N), or convert the weights to safetensors somewhere you trust"
        )
    raise HubError(f"{repo_id} has no model weights at its top level (no .safetensors file): is it a model "
                   "repository?")


def download_model(
    repo_id: str, out: str | Path | None = None, revision: str | None = None, *, verify: bool = True
) -> Download:
    """Download what gptlab needs of the model `repo_id` (at `revision`: a branch, tag or commit; default the
    main branch) into `out` (default `default_directory(repo_id)`); see the module docstring."""
    import huggingface_hub

    directory = Path(out) if out is not None else default_directory(repo_id)
    if offline():
        raise HubError(
            f"HF_HUB_OFFLINE is set, so {repo_id} cannot be downloaded: download it where there is a network "
            f"(`gptlab download {repo_id}`) and pass its local directory to gptlab instead"
        )
    with _hub_errors(repo_id, revision, directory):
        info = huggingface_hub.model_info(repo_id, revision=revision, files_metadata=True)
    siblings = list(getattr(info, "siblings", None) or [])
    commit = getattr(info, "sha", None) or revision or "main"
    files, weights = select_files(repo_id, [s.rfilename for s in siblings])
    _fetch(repo_id, commit, directory, files)
    if weights == "index":
        shards = _index_shards(directory / SAFETENSORS_INDEX, repo_id, {s.rfilename for s in siblings})
        _fetch(repo_id, commit, directory, shards)
        files += shards
    if verify:
        check_hashes(directory, files, {s.rfilename: _lfs_sha256(s) for s in siblings})
    size = sum((directory / f).stat().st_size for f in files)
    return Download(repo_id, commit, directory, tuple(files), size)


def check_hashes(directory: Path, files: Iterable[str], sha256: dict[str, str | None]) -> None:
    """Compare each of `files` that has an expected sha256 with its content; a mismatching file is deleted (so
    that the next download fetches it again) and raises HubError."""
    for name in files:
        expected = sha256.get(name)
        if not expected:
            continue
        path = directory / name
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != expected.lower():
            path.unlink()
            raise HubError(f"{path} does not match the sha256 the Hub lists for it (a corrupted download?): it was "
                           "deleted; run the download again")


def _fetch(repo_id: str, commit: str, directory: Path, files: list[str]) -> None:
    import huggingface_hub

    with _hub_errors(repo_id, commit, directory):
        # patterns are globs: escaped, each one matches its own file only
        huggingface_hub.snapshot_download(repo_id, revision=commit, local_dir=directory,
                                          allow_patterns=[glob.escape(f) for f in files])


def _index_shards(index: Path, repo_id: str, listed: set[str]) -> list[str]:
    """The weight files a safetensors index names (each one must be in the repository, at the top level)."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HubError(f"{index} has no weight_map: the repository {repo_id} looks broken")
    shards = sorted({str(v) for v in weight_map.values()})
    missing = [s for s in shards if s not in listed or "/" in s or not s.endswith(".safetensors")]
    if missing:
        raise HubError(f"{index} names weight files that are not safetensors files of {repo_id}: "
                       f"{', '.join(missing[:3])}")
    return shards


def _lfs_sha256(sibling: Any) -> str | None:
    lfs = getattr(sibling, "lfs", None)
    if lfs is None:
        return None
    return lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, directory: Path) -> Iterator[None]:
    """huggingface_hub's and the network's exceptions -> one HubError line each."""
    from huggingface_hub import errors

    at = f" at revision {revision}" if revision else ""
    login = "log in with `hf auth login` (or set HF_TOKEN)"
    elsewhere = "download it where there is a network and pass its local directory to gptlab instead"
    try:
        yield
    except HubError:
        raise
    except errors.OfflineModeIsEnabled:
        raise HubError(f"huggingface_hub is in offline mode, so {repo_id} cannot be downloaded: {elsewhere}") from None
    except errors.GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its terms on https://huggingface.co/{repo_id} and {login}") \
            from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit)") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"no model repository {repo_id} on the Hub (or it is private: {login})") from None
    except errors.HFValidationError as e:
        raise HubError(f"{repo_id!r} is not a Hub repository id (owner/name): {_first_line(e)}") from None
    except errors.LocalEntryNotFoundError:  # how snapshot_download reports a failed connection
        raise HubError(f"cannot reach the Hugging Face Hub to download {repo_id}{at}: check the connection, or "
                       f"{elsewhere}") from None
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"the Hub refused access to {repo_id} (HTTP {status}): {login}") from None
        raise HubError(f"the Hub answered {repo_id}{at} with an error: {_first_line(e)}") from None
    except Exception as e:
        if any(c.__name__ in _NETWORK_ERRORS for c in type(e).__mro__):
            raise HubError(f"cannot reach the Hugging Face Hub ({type(e).__name__}: {_first_line(e)}): check the "
                           f"connection, or {elsewhere}") from None
        if isinstance(e, OSError):  # the disk: full, read-only, permissions
            raise HubError(f"cannot write the download to {directory}: {_first_line(e)}") from None
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
