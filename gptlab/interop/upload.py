"""A model on the Hugging Face Hub (`gptlab upload RUN REPO_ID`): the model card, and the push of a prepared
directory through huggingface_hub (`HfApi.create_repo`, `upload_folder`), with one-line errors for a missing
token, offline mode and a refused or failed request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptlab.checkpoint.layout import RESOLVED_CONFIG
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import parse_json, read_json_or_empty, read_utf8

CARD_FILE = "README.md"
METRICS_FILE = "metrics.jsonl"  # the run's log rows (train/runlog.py writes it; read here as plain JSON lines)


def read_run(run_dir: Path | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A run directory's metrics rows and recipe (empty when SRC is a bare checkpoint or a row is torn)."""
    rows: list[dict[str, Any]] = []
    recipe: dict[str, Any] = {}
    if run_dir is None:
        return rows, recipe
    if (run_dir / METRICS_FILE).is_file():
        for line in read_utf8(run_dir / METRICS_FILE).splitlines():
            try:
                row = parse_json(line)
            except ValueError:  # a torn last line from a killed run
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows, read_json_or_empty(run_dir / RESOLVED_CONFIG)


def recipe_settings(recipe: dict[str, Any]) -> dict[str, Any]:
    """A card's view of config.resolved.json ({"train": the recipe's settings, "model": the model's config, "data":
    the data directory, ...}): the settings, with the data directory by its name (its path is the trainer's
    machine's, nothing to publish)."""
    train = recipe.get("train")
    settings = dict(train) if isinstance(train, dict) else {}
    data = recipe.get("data")
    if isinstance(data, str) and data:
        settings["data"] = Path(data).name or data
    return settings


def model_card(repo_id: str, cfg: GPTConfig, architecture: str, n_params: int, rows: list[dict[str, Any]],
               recipe: dict[str, Any]) -> str:
    """README.md for the Hub: what the model is, what it was trained on and how, and the run's metrics."""
    lines = ["---", "library_name: transformers", "tags: [gptlab]", "---", "", f"# {repo_id.split('/')[-1]}", "",
             f"A {architecture} ({n_params:,} parameters: {cfg.n_layer} layers, {cfg.n_head} heads, width "
             f"{cfg.n_embd}, context {cfg.block_size}, vocabulary {cfg.vocab_size}) trained with gptlab and "
             "saved in Hugging Face's format (`AutoModelForCausalLM.from_pretrained`).", ""]
    settings = recipe_settings(recipe)
    if settings:
        lines += ["## Training", ""]
        for key in ("data", "model", "init_from", "objective", "max_steps", "batch_size", "optimizer", "lr",
                    "schedule", "seed"):
            if settings.get(key) is not None:
                lines.append(f"- {key}: `{settings[key]}`")
        lines.append("")
    if rows:  # (a run logs train rows every log_interval and val rows apart: the last row may hold either)
        vals = [row["val_loss"] for row in rows if isinstance(row.get("val_loss"), (int, float))]
        trains = [row["train_loss"] for row in rows if isinstance(row.get("train_loss"), (int, float))]
        lines += ["## Metrics", "", "| metric | value |", "|---|---|", f"| steps | {rows[-1].get('step', '?')} |"]
        if trains:
            lines.append(f"| last train loss | {trains[-1]:.4f} |")
        if vals:
            lines += [f"| last val loss | {vals[-1]:.4f} |", f"| best val loss | {min(vals):.4f} |"]
        lines.append("")
    return "\n".join(lines)


def push_folder(folder: Path, repo_id: str, token: str | None = None, private: bool = False) -> str:
    """Create `repo_id` (if new) and upload `folder` into it; its URL. GptlabError in one line otherwise."""
    import httpx
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE:
        raise GptlabError("cannot upload: HF_HUB_OFFLINE is set (unset it to reach the Hub)")
    token = token or huggingface_hub.get_token()
    if not token:
        raise GptlabError("cannot upload: no Hugging Face token (run `hf auth login`, set HF_TOKEN or pass --token)")
    api = huggingface_hub.HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          commit_message="Upload a gptlab model")
    except OfflineModeIsEnabled:
        raise GptlabError("cannot upload: huggingface_hub is in offline mode") from None
    except HfHubHTTPError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GptlabError(f"cannot upload to {repo_id}: {first}") from None
    except (OSError, httpx.HTTPError) as e:  # no network, DNS, a refused connection
        raise GptlabError(f"cannot upload to {repo_id}: {e.__class__.__name__}: {e}") from None
    return str(url)
