"""The fine-tuning pipeline end to end, as the README's "Fine-tuning" section runs it: a small random Llama saved by
transformers -> `gptlab prepare chats.jsonl --tokenizer-from DIR` -> `gptlab train --init-from DIR --lora-rank 8`
(the loss falls, the base stays bit-identical) -> `gptlab chat RUN` answers -> `gptlab convert RUN OUT --to hf`
loads in transformers with equal logits -> the lm-eval adapter scores it as lm-eval's own hf backend does."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, corpus_text, hf_llama_dir

from gptlab.cli import main
from gptlab.loading import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def digest(directory: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file())).hexdigest()


def test_prepare_lora_chat_convert_and_score(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = corpus_text(30_000)
    base = hf_llama_dir(tmp_path / "base", text, block_size=64, chat_template=TEMPLATE)
    before = digest(base)
    lines = [line for line in text.splitlines() if 8 < len(line) < 24]
    chats = tmp_path / "chats.jsonl"  # the assistant repeats the user's line: learnable in a few steps
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": line},
                                                      {"role": "assistant", "content": line}]}) + "\n"
                             for line in lines[:300]))
    data = tmp_path / "data"
    assert main(["prepare", str(chats), "--tokenizer-from", str(base), "--out", str(data), "--block-size", "64"]) == 0
    meta = json.loads((data / "meta.json").read_text())
    assert meta["mask"] and meta["window_tokens"] == 65

    recipe = tmp_path / "lora.toml"
    settings = {"init_from": str(base), "lora_rank": 8, "lora_alpha": 16.0, "max_steps": 60, "batch_size": 8,
                "lr": 2e-2, "warmup_steps": 2, "eval_interval": 30, "log_interval": 10, "tensorboard": False,
                "threads": 1}
    recipe.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet"]) == 0
    vals = [json.loads(r)["val_loss"] for r in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in r]
    from gptlab.evaluation.loss import evaluate_split

    base_val = evaluate_split(load_model(base, dtype=torch.float32)[0], data)["val_loss"]
    assert vals[-1] < base_val - 1.0  # the loss over the assistant's tokens falls
    assert digest(base) == before  # the base's files are bit-identical

    chat = subprocess.run([sys.executable, "-m", "gptlab.cli", "chat", str(run), "--temperature", "0",
                           "--max-new-tokens", "20"], input="First Citizen:\n", capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert len(chat.stdout.splitlines()) == 1 and chat.stdout.strip()  # one answer for one line

    hf_out = tmp_path / "hf"
    assert main(["convert", str(run), str(hf_out), "--to", "hf"]) == 0
    ours, tok = load_model(run)
    ids = torch.tensor([tok.encode("Before we proceed any further, hear me speak.")])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], rtol=0, atol=1e-5)

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from gptlab.evaluation.harness import GptlabLM

    requests = [Instance("loglikelihood", {}, (f"<|im_start|>user\n{line}<|endoftext|>\n<|im_start|>assistant\n",
                                               line), i) for i, line in enumerate(lines[300:306])]
    gptlab_scores = GptlabLM(run, device="cpu", batch_size=3).loglikelihood(requests)
    hf_scores = HFLM(pretrained=str(hf_out), dtype="float32", device="cpu", batch_size=3).loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(gptlab_scores, hf_scores, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
