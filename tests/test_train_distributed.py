"""The GPU and multi-process logic of training, tested on a CPU: CUDA functions mocked, torch's fake process
group playing rank r of many, and the pure functions that split a batch over processes. Real 2-process gloo runs
(torchrun) are in test_train.py."""

from __future__ import annotations

import contextlib
import datetime
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gptlab.errors import GptlabError
from gptlab.train import build_train_config, load_train_config
from gptlab.train.config import micro_steps, resume_differences
from gptlab.train.distributed import Processes, init_distributed, shard_model
from gptlab.train.optim import OptimizerSpec, build_optimizers
from gptlab.train.setup import check_dtype, resolve_dtype

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs").glob("*.toml"))


# --- B2: one recipe, any number of processes ------------------------------------------------------------------
# Every shipped recipe splits at 1, 2, 4 and 8 processes; gpt2_124m (the GPU recipe), shakespeare_char and the 5-min
# recipe at 16 too. The two 24-sequence CPU recipes do not split over 16, nor lora's 16 sequences of 4 over 8 or 16:
# those say so in one line.
DOES_NOT_SPLIT = {("speedrun_cpu", 16), ("shakespeare_char_1min", 16), ("lora", 8), ("lora", 16)}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_splits_over_1_to_16_processes(recipe: Path) -> None:
    cfg = load_train_config(recipe, {"init_from": "base"} if recipe.stem == "lora" else None)  # lora needs a base
    for world in (1, 2, 4, 8, 16):
        if (recipe.stem, world) in DOES_NOT_SPLIT:
            with pytest.raises(GptlabError, match=r"^batch_size \d+ does not split over") as e:
                micro_steps(cfg, world)
            assert "\n" not in str(e.value)
            continue
        accum = micro_steps(cfg, world)
        micro = cfg.batch_size // (world * accum)
        assert world * accum * micro == cfg.batch_size, (recipe.stem, world)
        if cfg.micro_batch_size is not None:
            assert micro == cfg.micro_batch_size


def test_gpt2_recipe_keeps_its_batch_on_8_gpus() -> None:
    """The bug: batch_size 480 with grad_accum 40 refused 8 processes (480 % 320)."""
    cfg = load_train_config(REPO / "configs" / "gpt2_124m.toml")
    assert cfg.batch_size == 480 and cfg.grad_accum is None
    assert [micro_steps(cfg, w) for w in (1, 2, 4, 8, 16)] == [48, 24, 12, 6, 3]


def test_micro_batch_size_and_grad_accum() -> None:
    # grad_accum alone works as it always did; neither: one micro-step
    assert micro_steps(build_train_config({"batch_size": 32, "grad_accum": 4}), 2) == 4
    assert micro_steps(build_train_config({"batch_size": 32}), 4) == 1
    with pytest.raises(GptlabError, match="^batch_size 32 does not split over 3 process"):
        micro_steps(build_train_config({"batch_size": 32, "grad_accum": 4}), 3)
    # micro_batch_size: grad_accum follows the number of processes
    cfg = build_train_config({"batch_size": 32, "micro_batch_size": 4})
    assert [micro_steps(cfg, w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(GptlabError, match="^batch_size 32 does not split over 16 process.*micro_batch_size 4"):
        micro_steps(cfg, 16)
    # both: they must agree on this number of processes
    both = build_train_config({"batch_size": 32, "micro_batch_size": 4, "grad_accum": 2})
    assert micro_steps(both, 4) == 2
    with pytest.raises(GptlabError, match="^grad_accum 2 disagrees with micro_batch_size 4") as e:
        micro_steps(both, 1)
    assert "\n" not in str(e.value)
    # checked with the recipe, before any process starts: what splits on no number of processes
    for values, field in [({"batch_size": 30, "micro_batch_size": 4}, "micro_batch_size"),
                          ({"batch_size": 30, "grad_accum": 4}, "grad_accum"),
                          ({"batch_size": 32, "micro_batch_size": 4, "grad_accum": 3}, "grad_accum"),
                          ({"micro_batch_size": 0}, "micro_batch_size")]:
        with pytest.raises(GptlabError, match=field):
            build_train_config(values)


def test_split_keys_may_change_on_resume_and_new_keys_keep_old_runs_resumable() -> None:
    cfg = build_train_config({"batch_size": 32, "micro_batch_size": 4, "grad_accum": 8})
    saved = build_train_config({"batch_size": 32, "grad_accum": 2}).to_dict()
    assert resume_differences(saved, cfg) == []  # the same global batch, split otherwise
    for key in ("micro_batch_size", "distributed_timeout"):  # a checkpoint from before these keys
        del saved[key]
    assert resume_differences(saved, cfg) == []
    assert resume_differences({**saved, "batch_size": 64}, cfg) == ["batch_size"]


# --- B6: bf16 only where the GPU has bf16 units -----------------------------------------------------------------
@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA GPU whose compute capability the test sets; is_bf16_supported() says yes, as torch's default
    (including_emulation=True) does on sm70/75."""
    state = {"capability": (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", None)
    return state


@pytest.mark.parametrize(("capability", "auto"), [((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float16"),
                                                  ((7, 0), "float16"), ((6, 1), "float32")])
def test_auto_dtype_on_gpus(gpu, capability: tuple[int, int], auto: str) -> None:
    gpu["capability"] = capability
    assert resolve_dtype("auto", "cuda") == auto
    assert resolve_dtype("auto", "cuda:1") == auto
    if auto == "bfloat16":
        check_dtype("bfloat16", "cuda")
    else:  # V100/T4 only emulate bf16: refused, with what to use instead
        with pytest.raises(GptlabError, match=r"^dtype bfloat16: this GPU \(sm\d+\) has no bfloat16 units.*float16"):
            check_dtype("bfloat16", "cuda")
    check_dtype("float16", "cuda")


def test_float16_on_a_gpu_trains_with_a_grad_scaler() -> None:
    """What auto picks on sm70/75: Precision adds loss scaling to fp16 autocast."""
    from gptlab.config import GPTConfig
    from gptlab.model import GPT
    from gptlab.train.precision import Precision

    model = GPT(GPTConfig.preset("tiny", n_embd=16, n_head=2, n_kv_head=2, block_size=8, vocab_size=32))
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else contextlib.nullcontext():
        precision = Precision(model, "float16", "cuda", attention_fp32=True, distributed=False)
    assert precision.mode == "autocast" and precision.scaler is not None


# --- B7: joining the process group ------------------------------------------------------------------------------
@pytest.fixture
def fake_group(monkeypatch):
    """dist.init_process_group replaced by torch's fake process group (collectives are no-ops), recording what
    gptlab asked for."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls: list[tuple[str, dict]] = []
    real = dist.init_process_group

    def init(backend: str, **options) -> None:
        calls.append((backend, options))
        real("fake", store=FakeStore(), rank=int(__import__("os").environ["RANK"]),
             world_size=int(__import__("os").environ["WORLD_SIZE"]))

    monkeypatch.setattr(dist, "init_process_group", init)
    yield calls
    if dist.is_initialized():
        dist.destroy_process_group()


def test_world_size_without_local_rank_is_refused(monkeypatch, fake_group) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for device in ("cuda", "cpu"):
        with pytest.raises(GptlabError, match="^WORLD_SIZE=16 but LOCAL_RANK is not set: launch with torchrun"):
            init_distributed(device)
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(GptlabError, match="^WORLD_SIZE=16 but RANK is not set"):
        init_distributed("cpu")
    monkeypatch.setenv("RANK", "nine")
    with pytest.raises(GptlabError, match="^the environment variable RANK='nine' must be a whole number"):
        init_distributed("cpu")
    assert fake_group == []  # refused before joining anything


def test_second_node_takes_its_local_gpu_and_binds_nccl_to_it(monkeypatch, gpu, fake_group) -> None:
    """RANK 9 of 16 on the second node of 8-GPU machines is that node's GPU 1 (not cuda:0 as before: every
    process of a node on one GPU)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    procs = init_distributed("cuda", timeout=90)
    assert procs == Processes(rank=9, world=16, device="cuda:1") and chosen == ["cuda:1"]
    (backend, options), = fake_group
    assert backend == "nccl"
    assert options == {"device_id": torch.device("cuda:1"), "timeout": datetime.timedelta(seconds=90)}
    dist.destroy_process_group()
    monkeypatch.setenv("LOCAL_RANK", "8")  # more processes on this node than GPUs
    with pytest.raises(GptlabError, match="^LOCAL_RANK=8 but this node shows 8 GPU"):
        init_distributed("cuda")


def test_distributed_timeout_is_checked() -> None:
    assert build_train_config({"distributed_timeout": 120}).distributed_timeout == 120.0
    with pytest.raises(GptlabError, match="^distributed_timeout must be positive"):
        build_train_config({"distributed_timeout": 0})


# --- B11: torch too old for what the recipe asks ----------------------------------------------------------------
def test_torch_floor_and_one_line_errors_below_it(monkeypatch) -> None:
    assert '"torch>=2.9"' in (REPO / "pyproject.toml").read_text()  # torch.optim.Muon is 2.9's
    from gptlab.config import GPTConfig
    from gptlab.model import GPT

    model = GPT(GPTConfig.preset("tiny", n_embd=16, n_head=2, n_kv_head=2, block_size=8, vocab_size=32))
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(GptlabError, match=r"^optimizer_impl \"torch\" with optimizer muon needs torch >= 2\.9"):
        build_optimizers(model, OptimizerSpec(kind="muon", impl="torch"))
    build_optimizers(model, OptimizerSpec(kind="muon", impl="gptlab"))  # BatchedMuon needs no torch.optim.Muon
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", types.ModuleType("torch.distributed.fsdp"))
    with pytest.raises(GptlabError, match=r"^distributed = \"fsdp\" needs torch >= 2\.6"):
        shard_model(model)


