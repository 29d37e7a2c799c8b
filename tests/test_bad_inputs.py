"""Every bad input answered in one line: a table of command lines a new user (or an unkind machine) could give,
each with the exit code and a fragment of the message it must get. No row may print a traceback or hang.

Most rows run in-process (`gptlab.cli.main`, under a SIGALRM time bound: a hang fails the row instead of the
suite); a few run as real processes, for what only a process shows (a broken pipe, GPTLAB_DEBUG, a hang in
thread start-up). The damaged files they read are made once per module from one tiny trained run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, corpus_text, hf_llama_dir, hf_tokenizer_dir, make_data, time_bound, write_jsonl, write_recipe

from gptlab.cli import main

ROW_SECONDS = 120  # a time bound per row (not a performance target): only a hang comes near it
PROCESS_SECONDS = 600  # the same for a real process, whose start (importing torch) is slow on a loaded machine


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A data directory, a trained run (steps 2 and 4, a best), and damaged or mismatched copies of its files."""
    root = tmp_path_factory.mktemp("bad_inputs")
    os.environ.setdefault("GPTLAB_CACHE_DIR", str(root / "cache"))
    data = make_data(root, chars=20_000)
    recipe = write_recipe(root, max_steps=4, checkpoint_interval=2, eval_interval=2, keep_last=3, log_interval=2,
                          eval_tokens=256, warmup_steps=1)
    run = root / "run"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet"]) == 0
    w = {"root": root, "data": data, "recipe": recipe, "run": run, "ckpt": run / "checkpoints" / "step-0000004"}

    def copy(name: str) -> Path:
        shutil.copytree(run, root / name)
        return root / name

    def step(run_copy: Path, n: int = 4) -> Path:
        return run_copy / "checkpoints" / f"step-{n:07d}"

    model = lambda r: step(r) / "model.safetensors"  # noqa: E731
    w["trunc_model"] = copy("trunc_model")
    data_bytes = model(w["trunc_model"]).read_bytes()
    model(w["trunc_model"]).write_bytes(data_bytes[: len(data_bytes) // 2])
    w["empty_model"] = copy("empty_model")
    model(w["empty_model"]).write_bytes(b"")
    w["text_model"] = copy("text_model")
    model(w["text_model"]).write_text("this is not a safetensors file at all")
    w["trunc_opt"] = copy("trunc_opt")
    opt = step(w["trunc_opt"]) / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:100])
    for name, change in [("state_no_step", lambda s: s.pop("step")), ("state_bad_step", lambda s: s.update(step="ten")),
                         ("state_bad_rng", lambda s: s.update(rng=[1, 2]))]:
        w[name] = copy(name)
        path = step(w[name]) / "state.json"
        state = json.loads(path.read_text())
        change(state)
        path.write_text(json.dumps(state))
    w["state_not_json"] = copy("state_not_json")
    (step(w["state_not_json"]) / "state.json").write_text("{ torn")
    w["bad_shapes"] = copy("bad_shapes")
    cfg_path = step(w["bad_shapes"]) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"] = 64, 4, 4
    cfg_path.write_text(json.dumps(cfg))
    w["bad_config_field"] = copy("bad_config_field")
    cfg_path = step(w["bad_config_field"]) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["n_layer"] = "two"
    cfg_path.write_text(json.dumps(cfg))
    w["empty_run"] = root / "empty_run"
    w["empty_run"].mkdir()
    other = root / "other_text"  # another vocabulary: digits only
    other.mkdir()
    (other / "t.txt").write_text("0123456789\n" * 2000)
    w["other_data"] = root / "other_data"
    assert main(["prepare", str(other / "t.txt"), "--tokenizer", "char", "--out", str(w["other_data"])]) == 0
    w["a_file"] = root / "a_file.txt"
    w["a_file"].write_text("not a directory\n")
    w["git_dir"] = root / "git_dir"  # someone's project with a config.json: convert must not replace it
    (w["git_dir"] / ".git").mkdir(parents=True)
    (w["git_dir"] / "config.json").write_text("{}")
    w["big_prompt"] = root / "big_prompt.txt"
    w["big_prompt"].write_text("a" * 50_000_000)
    w["latin1_prompt"] = root / "latin1.txt"
    w["latin1_prompt"].write_bytes("caf\xe9".encode("latin-1"))
    # model directories whose chat template is hostile, and chats to render with them
    w["chats"] = write_jsonl(root / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "hello"}]}] * 2)
    for name, template in [("include", "{% include 'x.jinja' %}"), ("number", 3), ("loops", LOOPS)]:
        w[f"tok_{name}"] = hf_tokenizer_dir(root / f"tok_{name}", {"chat_template": template})
    w["tok_link"] = hf_tokenizer_dir(root / "tok_link", {})
    (w["tok_link"] / "chat_template.jinja").symlink_to(w["latin1_prompt"])
    # a LoRA run on the trained run, and copies whose lora.json was edited
    w["lora"] = root / "lora"
    assert main([*fill(TRAIN, w), "--out", str(w["lora"]), "--init-from", str(w["ckpt"]), "--lora-rank", "2"]) == 0
    for name, change in [("lora_alpha_nan", {"alpha": float("nan")}), ("lora_rank_huge", {"rank": 1_000_000_000}),
                         ("lora_rank_text", {"rank": "8"}), ("lora_base_self", "self")]:
        w[name] = copy_lora = root / name
        shutil.copytree(w["lora"], copy_lora)
        for path in copy_lora.glob("checkpoints/*/lora.json"):
            meta = json.loads(path.read_text())
            if change == "self":
                meta["base"]["path"] = str(path.parent)
            else:
                meta.update(change)
            path.write_text(json.dumps(meta))
    w["hf_loops"] = hf_llama_dir(root / "hf_loops", corpus_text(3000), chat_template=LOOPS)
    w["trunc_tok_meta"] = copy("trunc_tok_meta")
    meta = step(w["trunc_tok_meta"]) / "tokenizer_meta.json"
    meta.write_bytes(meta.read_bytes()[:40])
    w["trunc_bpe"] = root / "trunc_bpe"
    assert main(["prepare", str(other / "t.txt"), "--tokenizer", "bpe", "--vocab-size", "300", "--out",
                 str(w["trunc_bpe"])]) == 0
    bpe = w["trunc_bpe"] / "tokenizer.json"
    bpe.write_bytes(bpe.read_bytes()[:200])
    w["latin1_recipe"] = root / "latin1.toml"
    w["latin1_recipe"].write_bytes(recipe.read_bytes() + "# caf\xe9\n".encode("latin-1"))
    w["latin1_metrics"] = copy("latin1_metrics")
    with open(w["latin1_metrics"] / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 5, "note": "caf\xe9"}\n')
    return w


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 1e10 steps


TRAIN = ["train", "{recipe}", "--data", "{data}", "--quiet"]
# (id, argv with {placeholders} from `world`, expected exit code, a fragment of the message)
ROWS = [
    # --- damaged or mismatched checkpoints
    ("sample-truncated-model", ["sample", "{trunc_model}/checkpoints/step-0000004", "--max-new-tokens", "2"], 2,
     "model.safetensors is truncated"),
    ("sample-empty-model", ["sample", "{empty_model}/checkpoints/step-0000004"], 2, "model.safetensors is empty"),
    ("sample-text-model", ["sample", "{text_model}/checkpoints/step-0000004"], 2, "not a safetensors file"),
    ("eval-truncated-model", ["eval", "{trunc_model}/checkpoints/step-0000004", "--data", "{data}"], 2,
     "model.safetensors is truncated"),
    ("convert-truncated-model", ["convert", "{trunc_model}/checkpoints/step-0000004", "{root}/conv_out"], 2,
     "model.safetensors is truncated"),
    ("eval-config-shapes", ["eval", "{bad_shapes}/checkpoints/step-0000004", "--data", "{data}"], 2,
     "the model's config implies"),
    ("sample-config-field", ["sample", "{bad_config_field}/checkpoints/step-0000004"], 2, "config.json"),
    ("resume-truncated-model", [*TRAIN, "--out", "{trunc_model}", "--resume"], 2, "step-0000002 is intact"),
    ("resume-empty-model", [*TRAIN, "--out", "{empty_model}", "--resume"], 2, "step-0000002 is intact"),
    ("resume-truncated-optimizer", [*TRAIN, "--out", "{trunc_opt}", "--resume"], 2,
     "optimizer.safetensors is truncated"),
    ("resume-state-missing-key", [*TRAIN, "--out", "{state_no_step}", "--resume"], 2, "lacks the key 'step'"),
    ("resume-state-wrong-type", [*TRAIN, "--out", "{state_bad_step}", "--resume"], 2, "step has the wrong type"),
    ("resume-state-rng-type", [*TRAIN, "--out", "{state_bad_rng}", "--resume"], 2, "rng has the wrong type"),
    ("resume-state-not-json", [*TRAIN, "--out", "{state_not_json}", "--resume"], 2, "state.json"),
    ("resume-config-shapes", [*TRAIN, "--out", "{bad_shapes}", "--resume"], 2, "config.json"),
    ("resume-other-vocabulary", ["train", "{recipe}", "--data", "{other_data}", "--out", "{run}", "--resume",
                                 "--quiet"], 2, "vocabulary"),
    ("init-from-other-tokenizer", ["train", "{recipe}", "--data", "{other_data}", "--out", "{root}/r_tok",
                                   "--init-from", "{run}", "--quiet"], 2,
     "was tokenized with another tokenizer (char, 11 ids"),
    ("init-from-other-tokenizer-lora", ["train", "{recipe}", "--data", "{other_data}", "--out", "{root}/r_tok",
                                        "--init-from", "{run}", "--lora-rank", "8", "--quiet"], 2,
     "prepare the data with --tokenizer-from"),
    ("resume-empty-dir", [*TRAIN, "--out", "{empty_run}", "--resume"], 2, "no checkpoint to continue from"),
    ("sample-missing-path", ["sample", "{root}/nowhere"], 2, "does not exist"),
    ("sample-truncated-tokenizer-meta", ["sample", "{trunc_tok_meta}/checkpoints/step-0000004"], 2,
     "step-0000004/tokenizer_meta.json is damaged (not JSON"),
    ("prepare-tokenizer-from-truncated-bpe", ["prepare", "{a_file}", "--tokenizer-from", "{trunc_bpe}", "--out",
                                              "{root}/p_bpe"], 2, "trunc_bpe/tokenizer.json is damaged"),
    # --- devices and threads
    ("sample-device-potato", ["sample", "{ckpt}", "--device", "potato"], 2, "--device 'potato'"),
    ("sample-device-cuda", ["sample", "{ckpt}", "--device", "cuda"], 2, "CUDA is not available"),
    ("sample-device-meta", ["sample", "{ckpt}", "--device", "meta"], 2, "cannot run a model"),
    ("eval-device-meta", ["eval", "{ckpt}", "--data", "{data}", "--device", "meta"], 2, "cannot run a model"),
    ("chat-device-potato", ["chat", "{ckpt}", "--device", "potato"], 2, "potato"),
    ("train-device-potato", [*TRAIN, "--out", "{root}/r_dev", "--device", "potato"], 2, "device 'potato'"),
    ("train-device-cuda", [*TRAIN, "--out", "{root}/r_dev", "--device", "cuda:3"], 2, "CUDA is not available"),
    ("train-device-meta", [*TRAIN, "--out", "{root}/r_dev", "--device", "meta"], 2, "cannot run a model"),
    ("train-threads-negative", [*TRAIN, "--out", "{root}/r_thr", "--threads", "-1"], 2, "threads must be"),
    ("train-threads-huge", [*TRAIN, "--out", "{root}/r_thr", "--threads", "10000"], 2, "threads must be between"),
    # --- the filesystem
    ("train-out-empty", [*TRAIN, "--out", ""], 2, "--out is empty"),
    ("train-out-file", [*TRAIN, "--out", "{a_file}"], 2, "is a file"),
    ("train-out-under-file", [*TRAIN, "--out", "{a_file}/run"], 2, "is a file"),
    ("prepare-out-empty", ["prepare", "{a_file}", "--tokenizer", "char", "--out", ""], 2, "--out is empty"),
    ("prepare-input-empty", ["prepare", "", "--tokenizer", "char", "--out", "{root}/p_empty"], 2,
     "an INPUT is empty"),
    ("prepare-input-blank", ["prepare", "{a_file}", " ", "--tokenizer", "char", "--out", "{root}/p_empty"], 2,
     "an INPUT is empty"),
    ("prepare-out-file", ["prepare", "{a_file}", "--tokenizer", "char", "--out", "{a_file}"], 2, "is a file"),
    ("convert-dst-empty", ["convert", "{ckpt}", ""], 2, "DST is empty"),
    ("convert-dst-file", ["convert", "{ckpt}", "{a_file}"], 2, "is a file"),
    ("convert-dst-not-ours", ["convert", "{ckpt}", "{git_dir}"], 2, "gptlab did not write"),
    ("train-recipe-not-utf8", ["train", "{latin1_recipe}", "--data", "{data}", "--out", "{root}/r_x"], 2,
     "latin1.toml is not UTF-8 text (bad byte at offset"),
    ("plot-metrics-not-utf8", ["plot", "{latin1_metrics}", "-o", "{root}/plot.png"], 2,
     "metrics.jsonl is not UTF-8 text (bad byte at offset"),
    # --- sizes
    ("train-batch-huge", [*TRAIN, "--out", "{root}/r_mem", "--batch-size", "100000000"], 2, "of memory per step"),
    ("train-model-huge", [*TRAIN, "--out", "{root}/r_mem", "--n-embd", "1048576", "--n-head", "2"], 2,
     "of memory per step"),
    ("prepare-vocab-huge", ["prepare", "{a_file}", "--tokenizer", "bpe", "--vocab-size", "1000000000000", "--out",
                            "{root}/p_vocab"], 2, "too large"),
    ("prepare-workers-huge", ["prepare", "{a_file}", "--tokenizer", "char", "--workers", "100000", "--out",
                              "{root}/p_w"], 2, "at most"),
    ("sample-prompt-50mb", ["sample", "{ckpt}", "--prompt-file", "{big_prompt}", "--max-new-tokens", "2"], 2,
     "more than the model's context"),
    ("sample-prompt-not-utf8", ["sample", "{ckpt}", "--prompt-file", "{latin1_prompt}"], 2, "not UTF-8"),
    ("eval-block-size-negative", ["eval", "{ckpt}", "--data", "{data}", "--block-size", "-1"], 2,
     "--block-size must be at least 1"),
    ("eval-block-size-past-context", ["eval", "{ckpt}", "--data", "{data}", "--block-size", "1000"], 2,
     "--block-size 1000 is more than the model's context of 32 tokens"),
    ("eval-block-size-zero", ["eval", "{ckpt}", "--data", "{data}", "--block-size", "0"], 2, "--block-size"),
    ("eval-batch-size-huge", ["eval", "{ckpt}", "--data", "{data}", "--batch-size", "100000000"], 2,
     "--batch-size 100000000 x block_size 32 needs at least"),
    ("eval-batch-size-negative", ["eval", "{ckpt}", "--data", "{data}", "--batch-size", "-1"], 2,
     "--batch-size must be at least 1"),
    # --- chat templates of a model directory
    ("prepare-template-include", ["prepare", "{chats}", "--tokenizer-from", "{tok_include}", "--out", "{root}/p_t",
                                  "--block-size", "16"],
     2, "tokenizer_config.json uses {% include %}"),
    ("prepare-template-loops", ["prepare", "{chats}", "--tokenizer-from", "{tok_loops}", "--out", "{root}/p_t",
                                  "--block-size", "16"], 2,
     "tokenizer_config.json takes more than 0.5 s to render"),
    ("prepare-template-number", ["prepare", "{chats}", "--tokenizer-from", "{tok_number}", "--out", "{root}/p_t",
                                  "--block-size", "16"],
     2, "tokenizer_config.json: chat_template must be a Jinja template string, got int"),
    ("prepare-template-link", ["prepare", "{chats}", "--tokenizer-from", "{tok_link}", "--out", "{root}/p_t",
                                  "--block-size", "16"], 2,
     "outside the model directory"),
    ("chat-template-loops", ["chat", "{hf_loops}"], 2, "tokenizer_config.json takes more than 0.5 s to render"),
    # --- LoRA files
    ("sample-lora-alpha-nan", ["sample", "{lora_alpha_nan}", "--max-new-tokens", "2"], 2,
     "lora.json: alpha must be a finite number above 0, got nan"),
    ("sample-lora-rank-huge", ["sample", "{lora_rank_huge}", "--max-new-tokens", "2"], 2,
     "lora.json: LoRA rank 1000000000 is larger than the q layer's width 32"),
    ("sample-lora-rank-text", ["sample", "{lora_rank_text}", "--max-new-tokens", "2"], 2,
     "lora.json: rank must be a whole number"),
    ("sample-lora-base-self", ["sample", "{lora_base_self}", "--max-new-tokens", "2"], 2,
     "holds LoRA adapters itself"),
    # --- silently accepted nonsense
    ("train-grad-clip-nan", [*TRAIN, "--out", "{root}/r_x", "--grad-clip", "nan"], 2, "grad_clip must be a finite"),
    ("train-lr-inf", [*TRAIN, "--out", "{root}/r_x", "--lr", "inf"], 2, "lr must be a finite"),
    ("train-weight-decay-nan", [*TRAIN, "--out", "{root}/r_x", "--weight-decay", "nan"], 2, "weight_decay"),
    ("train-adam-eps-negative", [*TRAIN, "--out", "{root}/r_x", "--adam-eps", "-1"], 2,
     "adam_eps must be a number > 0"),
    ("train-adam-betas", [*TRAIN, "--out", "{root}/r_x", "--adam-betas", "1.5,0.9"], 2, "adam_betas"),
    ("train-eval-tokens-zero", [*TRAIN, "--out", "{root}/r_x", "--eval-tokens", "0"], 2, "eval_tokens must be"),
    ("train-seed-huge", [*TRAIN, "--out", "{root}/r_x", "--seed", str(2**70)], 2, "seed must be an integer in [0, "),
    ("train-max-time-nan", [*TRAIN, "--out", "{root}/r_x", "--max-time", "nan"], 2, "max_time"),
    ("train-mlp-ratio-zero", [*TRAIN, "--out", "{root}/r_x", "--mlp-ratio", "0"], 2, "mlp_ratio must be a number > 0"),
    ("train-mlp-ratio-negative", [*TRAIN, "--out", "{root}/r_x", "--mlp-ratio", "-2"], 2, "mlp_ratio"),
    ("train-warmup-past-max-steps", [*TRAIN, "--out", "{root}/r_x", "--warmup-steps", "100000"], 2,
     "warmup_steps (100000) must be less than max_steps (4)"),
    ("train-dropout-nan", [*TRAIN, "--out", "{root}/r_x", "--dropout", "nan"], 2, "dropout"),
    ("sample-seed-huge", ["sample", "{ckpt}", "--seed", str(2**70), "--max-new-tokens", "2"], 2, "--seed"),
    ("sample-top-k-huge", ["sample", "{ckpt}", "--top-k", str(2**70), "--max-new-tokens", "2"], 2, "--top-k"),
    ("sample-num-samples-zero", ["sample", "{ckpt}", "--num-samples", "0"], 2, "--num-samples"),
    ("sample-max-new-tokens-negative", ["sample", "{ckpt}", "--max-new-tokens", "-1"], 2, "--max-new-tokens"),
]


def fill(argv: list[str], world: dict[str, Path]) -> list[str]:
    return [a.format(**{k: str(v) for k, v in world.items()}) for a in argv]


@pytest.mark.parametrize(("argv", "code", "fragment"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_gets_one_line(world: dict[str, Path], capsys, argv: list[str], code: int,
                                 fragment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gptlab.tokenizer import template_sandbox

    monkeypatch.setattr(template_sandbox, "MAX_RENDER_SECONDS", 0.5)  # the runaway templates' rows: 5 s each
    with time_bound(ROW_SECONDS):
        rc = main(fill(argv, world))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == code and len(errors) == 1, err
    assert fragment in errors[0], err
    assert err.strip().splitlines()[-1] == errors[0], err  # nothing after it


def test_the_damaged_checkpoint_is_named_with_how_to_resume_from_the_intact_one(world: dict[str, Path],
                                                                                  capsys) -> None:
    run = world["root"] / "resume_hint"
    shutil.copytree(world["trunc_model"], run)
    assert main(fill([*TRAIN, "--out", str(run), "--resume"], world)) == 2
    err = capsys.readouterr().err
    damaged = run / "checkpoints" / "step-0000004"
    assert f"cannot resume from {damaged}" in err and f"mv {damaged} " in err
    # following the hint works: the damaged checkpoint moved aside, --resume continues from step 2
    hint = err.split("(mv ")[1].split(")")[0].split()
    os.replace(hint[0], hint[1])
    assert main(fill([*TRAIN, "--out", str(run), "--resume"], world)) == 0
    assert (run / "checkpoints" / "step-0000004" / "model.safetensors").is_file()


def test_an_unexpected_exception_is_one_line_unless_gptlab_debug(world: dict[str, Path], capsys,
                                                                  monkeypatch) -> None:
    from gptlab.cli import info

    def broken(args: object) -> int:
        raise RuntimeError("something\nthat spans lines")

    monkeypatch.setattr(info, "run", broken)
    monkeypatch.delenv("GPTLAB_DEBUG", raising=False)
    assert main(["info"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: internal error: RuntimeError: something that spans lines (set GPTLAB_DEBUG=1 for the "
                   "traceback)\n")
    monkeypatch.setenv("GPTLAB_DEBUG", "1")
    with pytest.raises(RuntimeError, match="something"):
        main(["info"])


def test_prepare_takes_the_tokenizer_of_a_run_or_a_checkpoint(world: dict[str, Path], capsys) -> None:
    from gptlab.tokenizer import fingerprint, load_tokenizer

    want = fingerprint(load_tokenizer(world["data"]))
    for source in ("run", "ckpt"):
        out = world["root"] / f"from_{source}"
        assert main(["prepare", str(world["a_file"]), "--tokenizer-from", str(world[source]), "--out", str(out),
                     "--val-fraction", "0.5"]) == 0, capsys.readouterr().err
        assert fingerprint(load_tokenizer(out)) == want


# --- rows that need a real process ------------------------------------------------------------------------------
def gptlab(*argv: str, stdin: str | None = None, env: dict[str, str] | None = None,
           timeout: int = PROCESS_SECONDS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptlab.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, input=stdin)


def test_sample_into_a_closed_pipe_ends_quietly(world: dict[str, Path]) -> None:
    """`gptlab sample ... | head -c 10`: the reader leaves early; no BrokenPipe traceback, exit 141 as a pipe
    writer killed by SIGPIPE would."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptlab.cli", "sample", str(world["ckpt"]), "--max-new-tokens", "3000",
         "--num-samples", "20", "--temperature", "1", "--seed", "1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()  # what `head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=PROCESS_SECONDS) == 141 and "Traceback" not in err and err == "", err


def test_threads_beyond_the_machine_are_refused_not_hung(world: dict[str, Path]) -> None:
    done = gptlab(*fill([*TRAIN, "--out", "{root}/p_threads", "--threads", "10000"], world))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: threads must be between 1 and"), done.stderr


def test_gptlab_debug_shows_the_traceback(world: dict[str, Path]) -> None:
    """A damaged file is the user's problem (one line even under GPTLAB_DEBUG); a bug's traceback is shown when
    asked for: here a corrupt tokenizer file read by a model path, through a real process."""
    plain = gptlab("sample", str(world["empty_model"] / "checkpoints" / "step-0000004"))
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1 and "Traceback" not in plain.stderr
    code = ("import gptlab.cli, sys; from gptlab.cli import info\n"
            "info.run = lambda args: 1 / 0\n"
            "sys.exit(gptlab.cli.main(['info']))\n")
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROCESS_SECONDS,
                           env={k: v for k, v in os.environ.items() if k != "GPTLAB_DEBUG"})
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr and "ZeroDivisionError" in quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROCESS_SECONDS,
                          env={**os.environ, "GPTLAB_DEBUG": "1"})
    assert loud.returncode == 1 and "Traceback" in loud.stderr


# --- the Python API ---------------------------------------------------------------------------------------------
def test_targets_outside_the_vocabulary_are_a_clear_value_error() -> None:
    import torch
    from helpers import tiny_model

    model = tiny_model(vocab_size=50)
    idx = torch.zeros(2, 4, dtype=torch.long)
    for bad in (50, 1000, -2):
        targets = torch.zeros(2, 4, dtype=torch.long)
        targets[1, 2] = bad
        with pytest.raises(ValueError, match=f"target {bad} is outside the vocabulary"):
            model(idx, targets)
    ok = torch.full((2, 4), -1)  # -1 is "ignored", not out of range
    ok[0, 0] = 49
    assert torch.isfinite(model(idx, ok)[1])


def test_a_seed_beyond_int64_is_a_clear_error() -> None:
    import torch
    from helpers import tiny_model

    from gptlab import generate

    with pytest.raises(ValueError, match="seed"):
        generate(tiny_model(), torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, seed=2**70)
