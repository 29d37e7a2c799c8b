"""Faults a run must survive without losing work: SIGKILLs at any moment (checkpoint writes included), a second
run on the same directory, a full disk, an evaluation that fails, a torn metrics line, a killed `prepare`.

The SIGKILL soak (20 kills, `-m slow`) and its fast version (3 kills) share one loop: start the run (resuming
when a checkpoint exists), kill it at a random moment, repeat; the weights it ends with must equal an
uninterrupted run's bit for bit (fp32, one thread: every step is deterministic).
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import PAIRS, REPO, make_data, needs_tiktoken_gpt2, pairs_data, write_recipe
from safetensors import SafetensorError
from safetensors.torch import load_file

from gptlab import checkpoint as ckpt
from gptlab import fileio
from gptlab.checkpoint import writing  # every checkpoint file is written there (save_file)
from gptlab.cli import main
from gptlab.loading import load_model, resolve_checkpoint
from gptlab.train.rewards import arithmetic_records
from gptlab.train.rundir import LOCK_FILE, trim_metrics


@pytest.fixture(autouse=True)
def _private_hardware_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gptlab-cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("faults_data"), chars=30_000)


def train_argv(recipe: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", *extra]


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gptlab.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def holds_lock(run: Path, pid: int) -> bool:
    try:
        return (run / LOCK_FILE).read_text().strip() == str(pid)
    except OSError:
        return False


def logged_steps(run: Path) -> int:
    try:
        return (run / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    """A step checkpoint's weights: the model's, or a LoRA run's adapters."""
    directory = run / "checkpoints" / ckpt.step_dir_name(step)
    return load_file(directory / (ckpt.LORA_FILE if (directory / ckpt.LORA_FILE).is_file() else ckpt.MODEL_FILE))


# --- SIGKILL at random moments ----------------------------------------------------------------------------------
def kill_and_resume(tmp_path: Path, data: Path, kills: int, seed: int, max_steps: int, **recipe_keys: object
                    ) -> tuple[int, int]:
    """Kill a run `kills` times at random moments (most of its time is spent writing checkpoints: one every
    step), resuming after each; then let it finish and compare with an uninterrupted run. Returns the kills made
    and how many of them stopped a checkpoint write midway (its temporary directory was left behind)."""
    recipe = write_recipe(tmp_path, max_steps=max_steps, checkpoint_interval=1, eval_interval=5, keep_last=2,
                          log_interval=1, eval_tokens=512, dropout=0.1, **recipe_keys)
    run, rng = tmp_path / "run", random.Random(seed)
    killed = mid_write = 0
    while killed < kills:
        resume = ["--resume"] if ckpt.list_step_checkpoints(run) else []
        logged = logged_steps(run)
        proc = start(train_argv(recipe, data, run, *resume))
        deadline = time.time() + 600  # a bound for a hang; starting torch is slow under load
        while not holds_lock(run, proc.pid):  # past start-up: the run is about to train
            assert proc.poll() is None or proc.returncode == 0, proc.communicate()
            assert time.time() < deadline, "the run did not start"
            time.sleep(0.01)
        while logged_steps(run) <= logged and proc.poll() is None:  # training: kills land in steps and writes
            assert time.time() < deadline, "the run did not train"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.2))
        if proc.poll() is not None:  # it reached the end first
            assert proc.returncode == 0, proc.communicate()
            break
        proc.kill()
        proc.communicate()
        killed += 1
        mid_write += bool(list((run / "checkpoints").glob(".*.tmp-*")))
    # the last resume runs to the end (every resume must start: a damaged state would fail here)
    assert main(train_argv(recipe, data, run, *(["--resume"] if ckpt.list_step_checkpoints(run) else []))) == 0
    ref = tmp_path / "ref"
    assert main(train_argv(recipe, data, ref)) == 0
    got, want = final_weights(run, max_steps), final_weights(ref, max_steps)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not list((run / "checkpoints").glob(".*")), "leftovers of interrupted writes were not cleaned"
    assert any((run / "checkpoints" / "best" / name).is_file() for name in (ckpt.MODEL_FILE, ckpt.LORA_FILE))
    return killed, mid_write


def test_a_few_sigkills_then_resume_match_an_uninterrupted_run(tmp_path: Path, data: Path) -> None:
    killed, _ = kill_and_resume(tmp_path, data, kills=3, seed=0, max_steps=40)
    assert killed >= 1


def test_dpo_sigkills_then_resume_match_an_uninterrupted_run(tmp_path: Path) -> None:
    """The preference objective resumes exactly too: its reference is rebuilt from the starting weights."""
    data = pairs_data(tmp_path, PAIRS * 4)
    killed, _ = kill_and_resume(tmp_path, data, kills=2, seed=2, max_steps=30, objective="dpo", block_size=96,
                                batch_size=4)
    assert killed >= 1


def test_grpo_sigkills_then_resume_match_an_uninterrupted_run(tmp_path: Path, monkeypatch) -> None:
    """GRPO resumes exactly: its rollouts are sampled from torch's RNG, which the checkpoints save. The reward (the
    completion's length, from a module of the test's own) varies within a group, so every step changes the weights."""
    (tmp_path / "length_reward.py").write_text(
        "def length(prompt, completion, reference):\n    return len(completion) / 4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    records = tmp_path / "sums.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_records(200, seed=0, digits=1)))
    data = tmp_path / "data"
    assert main(["prepare", str(records), "--tokenizer", "char", "--block-size", "24", "--no-pack", "--out",
                 str(data)]) == 0
    killed, _ = kill_and_resume(tmp_path, data, kills=2, seed=3, max_steps=20, objective="grpo", batch_size=2,
                                group_size=4, max_new_tokens=4, reward="length_reward:length", kl_beta=0.1)
    assert killed >= 1


def test_qlora_sigkills_then_resume_match_an_uninterrupted_run(tmp_path: Path, data: Path) -> None:
    """QLoRA resumes exactly: the base is quantized again from the same weights, the adapters come back on it."""
    base = tmp_path / "base"
    assert main(train_argv(write_recipe(tmp_path, "base.toml", max_steps=10, eval_interval=0), data, base)) == 0
    killed, _ = kill_and_resume(tmp_path, data, kills=2, seed=4, max_steps=20, init_from=str(base), lora_rank=4,
                                quantize="int4")
    assert killed >= 1


@pytest.mark.slow
def test_soak_twenty_sigkills_then_resume_match_an_uninterrupted_run(tmp_path: Path, data: Path) -> None:
    killed, mid_write = kill_and_resume(tmp_path, data, kills=20, seed=1, max_steps=400)
    assert killed == 20 and mid_write >= 1, (killed, mid_write)


# --- one run per directory ----------------------------------------------------------------------------------------
def test_a_second_train_on_the_same_run_dir_refuses(tmp_path: Path, data: Path, capsys) -> None:
    recipe = write_recipe(tmp_path, max_steps=100000, eval_interval=0)
    run = tmp_path / "run"
    first = start(train_argv(recipe, data, run))
    try:
        deadline = time.time() + 600  # a bound for a hang; starting torch is slow under load
        while not (run / "metrics.jsonl").is_file():
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline
            time.sleep(0.01)
        assert main(train_argv(recipe, data, run)) == 2
        err = capsys.readouterr().err
        assert f"is in use by another `gptlab train` (pid {first.pid})" in err and "Traceback" not in err
        assert first.poll() is None  # the first one goes on
    finally:
        first.kill()
        first.communicate()
    # its lock died with it: a lock file naming a dead pid is taken over, with a notice
    assert (run / LOCK_FILE).read_text().strip() == str(first.pid)
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--max-steps", "2",
                 "--warmup-steps", "1"]) == 0
    assert f"taking over {run / LOCK_FILE} from pid {first.pid}" in capsys.readouterr().err
    assert (run / LOCK_FILE).read_text() == ""  # released cleanly


# --- checkpoints/best/ and what readers pick ----------------------------------------------------------------------
def test_a_directory_is_replaced_in_one_step_and_only_when_gptlab_wrote_it(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "best"
    fileio.atomic_write_dir(target, lambda d: (d / "v").write_text("1"))
    assert (target / fileio.MARKER).is_file()
    seen = []
    real_exchange = fileio._exchange

    def watch(a: Path, b: Path) -> bool:  # the swap itself: before and after it, `best` is a whole directory
        seen.append((b / "v").read_text())
        done = real_exchange(a, b)
        seen.append((b / "v").read_text())
        return done

    monkeypatch.setattr(fileio, "_exchange", watch)
    fileio.atomic_write_dir(target, lambda d: (d / "v").write_text("2"))
    assert seen == ["1", "2"] and (target / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]  # the old copy is gone
    monkeypatch.setattr(fileio, "_exchange", lambda a, b: False)  # a system without renameat2: two renames
    fileio.atomic_write_dir(target, lambda d: (d / "v").write_text("3"))
    assert (target / "v").read_text() == "3" and sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    # someone's directory (no marker) is never replaced
    mine = tmp_path / "mine"
    (mine / ".git").mkdir(parents=True)
    with pytest.raises(fileio.GptlabError, match="was not written by gptlab"):
        fileio.atomic_write_dir(mine, lambda d: None)
    assert (mine / ".git").is_dir()


def test_sample_says_so_when_best_is_missing(tmp_path: Path, data: Path, capsys) -> None:
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path, max_steps=4, eval_interval=2, checkpoint_interval=2, keep_last=3, warmup_steps=1)
    assert main(train_argv(recipe, data, run)) == 0
    best = run / "checkpoints" / "best"
    # a run stopped between the two renames of a system without an atomic swap: the old best is aside
    aside = run / "checkpoints" / ".best.old-123"
    os.replace(best, aside)
    assert resolve_checkpoint(run) == aside and "using its previous copy" in capsys.readouterr().err
    import shutil

    shutil.rmtree(aside)
    assert resolve_checkpoint(run) == run / "checkpoints" / "step-0000004"
    assert "is missing though the run evaluated" in capsys.readouterr().err
    # the next write of the run cleans leftovers of interrupted writes
    (run / "checkpoints" / ".best.tmp-x").mkdir()
    (run / "checkpoints" / ".best.old-9").mkdir()
    ckpt.prune_checkpoints(run, keep_last=2)
    assert not list((run / "checkpoints").glob(".*"))


# --- an evaluation that fails, a full disk, a torn metrics line --------------------------------------------------
def test_a_failing_final_evaluation_keeps_the_weights(tmp_path: Path, data: Path, monkeypatch, capsys) -> None:
    from gptlab.train.trainer import Trainer

    def broken(self: Trainer) -> float:
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(Trainer, "evaluate", broken)
    run = tmp_path / "run"
    assert main(train_argv(write_recipe(tmp_path, max_steps=3, eval_interval=0, warmup_steps=1), data, run)) == 1
    assert "evaluation broke" in capsys.readouterr().err
    (step,) = ckpt.list_step_checkpoints(run)
    assert step.name == "step-0000003" and load_model(step)[0] is not None


def test_bad_training_keys_are_refused_before_the_first_step(tmp_path: Path, data: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(train_argv(write_recipe(tmp_path), data, run, "--eval-tokens", "0")) == 2
    assert "eval_tokens must be an integer >= 1" in capsys.readouterr().err and not run.exists()


FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"  # as safetensors says it


@pytest.mark.parametrize("lora", [False, True])
def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one(tmp_path: Path, data: Path, monkeypatch,
                                                                  capsys, lora: bool) -> None:
    real_save = writing.save_file
    calls = {"n": 0}
    weights = ckpt.LORA_FILE if lora else ckpt.OPTIMIZER_FILE

    def fills_the_disk(tensors, path, **kw) -> None:  # the second checkpoint's weights or optimizer do not fit
        if path.endswith(weights):
            calls["n"] += 1
            if calls["n"] > 1:
                raise SafetensorError(FULL_DISK)
        real_save(tensors, path, **kw)

    recipe = write_recipe(tmp_path, max_steps=4, checkpoint_interval=2, eval_interval=0, warmup_steps=1)
    extra: list[str] = []
    if lora:  # adapters on a small trained base
        assert main(train_argv(recipe, data, tmp_path / "base", "--max-steps", "2")) == 0
        extra = ["--init-from", str(tmp_path / "base"), "--lora-rank", "2"]
    monkeypatch.setattr(writing, "save_file", fills_the_disk)
    run = tmp_path / "run"
    assert main(train_argv(recipe, data, run, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith(f"error: no space left on the device of {run / 'checkpoints'}: writing step-0000004 "
                          "needs about") and "KiB" in err and "nothing was replaced" in err, err
    (good,) = ckpt.list_step_checkpoints(run)
    assert good.name == "step-0000002" and load_model(good)[0] is not None
    assert not list((run / "checkpoints").glob(".*"))  # the half-written one is gone
    monkeypatch.undo()
    assert main(train_argv(recipe, data, run, "--resume", *extra)) == 0  # and the run goes on from it


def test_a_full_disk_during_convert_to_hf_keeps_the_previous_copy(tmp_path: Path, data: Path, monkeypatch,
                                                                    capsys) -> None:
    recipe = write_recipe(tmp_path, max_steps=2, eval_interval=0, warmup_steps=1)
    assert main(train_argv(recipe, data, tmp_path / "run")) == 0
    dst = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "run"), str(dst), "--to", "hf"]) == 0
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    capsys.readouterr()

    def full(*args, **kw) -> None:
        raise SafetensorError(FULL_DISK)

    monkeypatch.setattr(writing, "save_file", full)
    assert main(["convert", str(tmp_path / "run"), str(dst), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no space left on the device of {tmp_path}: writing hf needs about"), err
    assert err.count("\n") == 1 and "nothing was replaced" in err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before and load_model(dst)[0] is not None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_full_disk_during_gguf_export_is_the_same_one_line(tmp_path: Path, data: Path, monkeypatch,
                                                            capsys) -> None:
    """gguf's buffered writer meets a full disk as a short write with no errno ("2048 requested and 1472 written",
    as on a 3 MB tmpfs): the same message as every other write, and no file left behind."""
    import shutil

    gguf = pytest.importorskip("gguf")
    recipe = write_recipe(tmp_path, max_steps=2, eval_interval=0, warmup_steps=1)
    assert main(train_argv(recipe, data, tmp_path / "run")) == 0
    capsys.readouterr()

    def short_write(self, *args, **kw) -> None:  # noqa: ANN001
        raise OSError("2048 requested and 1472 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short_write)
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(3 << 20, 3 << 20, 0))
    out = tmp_path / "m.gguf"
    assert main(["convert", str(tmp_path / "run"), str(out), "--to", "gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no space left on the device of {tmp_path}: writing m.gguf"), err
    assert err.count("\n") == 1 and "nothing was replaced" in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_torn_last_metrics_line_does_not_block_resume(tmp_path: Path, capsys) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "train_loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows) + '\n{"step": 4, "train_lo')
    trim_metrics(path, last_step=2)
    assert path.read_text().splitlines() == rows[:2]
    assert "dropped the torn last line" in capsys.readouterr().err
    path.write_text(rows[0] + "\ngarbage\n" + rows[1] + "\n")  # damage elsewhere is not silently dropped
    with pytest.raises(fileio.GptlabError, match="line 2 is not a metrics row"):
        trim_metrics(path, last_step=5)


# --- a killed prepare -------------------------------------------------------------------------------------------
def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@needs_tiktoken_gpt2
def test_a_killed_prepare_leaves_no_workers_and_no_partial_files(tmp_path: Path) -> None:
    text = tmp_path / "in.txt"
    text.write_text(("hello world, this is a line of text.\n" * 200) * 400)  # ~3 MB
    out = tmp_path / "data"
    code = ("import sys; from gptlab.data import preparation as p; p.PARALLEL_MIN_CHARS = 0\n"
            f"p.prepare([{str(text)!r}], {str(out)!r}, tokenizer='gpt2', workers=2, chunk_chars=1 << 12)\n")
    # no pipes: a surviving worker would hold them open, and reading them would hang instead of failing
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600  # a bound for a hang; starting torch is slow under load
    building = f".{out.name}.tmp-*/.*.partial"  # the new DATA_DIR is built beside `out`, then swapped in
    while not list(tmp_path.glob(building)) or len(descendants(proc.pid)) < 3:  # forkserver + 2 workers
        assert proc.poll() is None, "prepare ended early"
        assert time.time() < deadline, "prepare did not start its workers"
        time.sleep(0.01)
    family = descendants(proc.pid)
    proc.kill()
    proc.wait()
    deadline = time.time() + 30
    while any(alive(p) for p in family):
        assert time.time() < deadline, f"workers outlived a killed prepare: {[p for p in family if alive(p)]}"
        time.sleep(0.05)
    assert list(tmp_path.glob(building)) and not out.exists()  # SIGKILL runs no cleanup: the next run does it
    small = tmp_path / "small.txt"
    small.write_text("some text to prepare, long enough for both splits.\n" * 50)
    assert main(["prepare", str(small), "--tokenizer", "char", "--out", str(out)]) == 0
    assert not list(tmp_path.glob(f".{out.name}.*")) and not list(out.glob(".*.partial"))


def test_a_full_disk_during_prepare_says_what_was_needed_and_keeps_the_old_data(tmp_path: Path, monkeypatch,
                                                                                 capsys) -> None:
    from gptlab.data import preparation
    from gptlab.data.dataset import load_split, read_meta
    from gptlab.tokenizer import load_tokenizer

    class FillsUp:  # a token file on a disk with 1 KiB left
        def __init__(self, path: Path, mode: str) -> None:
            self.f, self.room = open(path, mode), 1024  # noqa: SIM115 - closed in __exit__

        def write(self, data: bytes) -> int:
            self.room -= len(data)
            if self.room < 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __enter__(self) -> FillsUp:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    def fake_open(path: Path, mode: str = "r", *args, **kw):  # noqa: ANN202 - reads go to the real open
        return FillsUp(path, mode) if "w" in mode else open(path, mode, *args, **kw)  # noqa: SIM115

    out = tmp_path / "data"
    (tmp_path / "good.txt").write_text("a good small text, prepared before the disk filled up.\n" * 50)
    assert main(["prepare", str(tmp_path / "good.txt"), "--tokenizer", "char", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(preparation, "open", fake_open, raising=False)
    text = tmp_path / "in.txt"
    text.write_text("words and more words, with other letters: xyz\n" * 1000)
    assert main(["prepare", str(text), "--tokenizer", "char", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no space left on the device of {out}: writing train.bin needs about 89.8 KiB")
    assert "nothing was replaced" in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # meta.json and the tokenizer untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "good.txt", "in.txt"]  # nothing half-built
    assert load_tokenizer(out).decode(load_split(out, "train")[:6]) == "a good" and read_meta(out)["vocab_size"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed here")
def test_tensorboard_asked_for_but_missing_is_said_once(tmp_path: Path, data: Path, capsys) -> None:
    recipe = write_recipe(tmp_path, max_steps=2, tensorboard=True, eval_interval=0, warmup_steps=1)
    assert main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().err.count("tensorboard package is not installed") == 1


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_written_files_honour_the_umask(tmp_path: Path, data: Path, umask: int, file_mode: int,
                                        dir_mode: int) -> None:
    """As open() and mkdir() would: mkstemp's 0600 (and mkdtemp's 0700) are not left on what gptlab writes."""
    from gptlab.data import prepare

    def mode(p: Path) -> int:
        return p.stat().st_mode & 0o777

    old = os.umask(umask)
    try:
        assert fileio.current_umask() == umask
        fileio.atomic_write_text(tmp_path / "a.txt", "text")
        fileio.atomic_write_dir(tmp_path / "d", lambda tmp: fileio.atomic_write_json(tmp / "x.json", {}))
        (tmp_path / "in.txt").write_text("some text to prepare, long enough for both splits.\n" * 50)
        prepare([tmp_path / "in.txt"], tmp_path / "data", tokenizer="char")
        recipe = write_recipe(tmp_path, max_steps=2, eval_interval=0, warmup_steps=1)
        assert main(train_argv(recipe, data, tmp_path / "run")) == 0
    finally:
        os.umask(old)
    (step,) = ckpt.list_step_checkpoints(tmp_path / "run")
    assert mode(tmp_path / "a.txt") == file_mode
    assert mode(tmp_path / "d") == mode(tmp_path / "data") == mode(step) == dir_mode
    written = [tmp_path / "d" / "x.json", *(tmp_path / "data").iterdir(), *step.iterdir()]
    assert {p.name: mode(p) for p in written} == {p.name: file_mode for p in written}
