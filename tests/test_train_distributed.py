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
from gptlab.train.rng import rank_seed, restore_rng_state, rng_state, seed_dropout
from gptlab.train.setup import check_dtype, resolve_dtype

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs").glob("*.toml"))


# --- B2: one recipe, any number of processes ------------------------------------------------------------------
# Every shipped recipe splits at 1, 2, 4 and 8 processes; gpt2_124m (the GPU recipe), shakespeare_char, the speedrun
# and the 5-min recipe at 16 too. The 1-min recipe's 24 sequences do not split over 16, nor lora's 16 sequences of 4
# over 8 or 16: those say so in one line.
DOES_NOT_SPLIT = {("shakespeare_char_1min", 16), ("lora", 8), ("lora", 16)}


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
    with pytest.raises(GptlabError, match=r"^distributed_timeout must be in \(0, "):
        build_train_config({"distributed_timeout": 0})


# --- B8: a check that fails on one process stops them all -----------------------------------------------------
def test_a_failed_check_on_any_rank_fails_every_rank(monkeypatch, fake_group) -> None:
    """Rank 3 of 8, its own checks passed: it raises when a peer's failed (the fake group's all-reduce is a no-op,
    so the peer's vote is written in by hand), and goes on when none failed."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    procs = init_distributed("cpu")
    with procs.all_or_none("the checks"):
        pass  # nobody failed
    votes = []

    def all_reduce(t: torch.Tensor, *args, **kwargs) -> None:
        votes.append(t.clone())
        t[5] = 1.0  # rank 5 failed

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(GptlabError, match=r"^rank 5 of 8 processes failed the checks \(its own error says why\)"):
        with procs.all_or_none("the checks"):
            pass
    with pytest.raises(GptlabError, match="already holds checkpoints"):  # the failing rank: its own error
        with procs.all_or_none("the checks"):
            raise GptlabError("RUN already holds checkpoints")
    assert [v.tolist() for v in votes] == [[0.0] * 8, [0, 0, 0, 1, 0, 0, 0, 0]]
    alone = Processes(0, 1, "cpu")  # one process: no vote at all
    with pytest.raises(GptlabError, match="mine"), alone.all_or_none("the checks"):
        raise GptlabError("mine")


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


# --- B1, B12: each process's own dropout stream, saved and put back ---------------------------------------------
def _cpu_rank_states(seed: int, world: int, draws: int = 3) -> list[dict]:
    """The CPU states ranks 0..world-1 would reach: the identical init, their own seed, `draws` dropout masks."""
    states = []
    for rank in range(world):
        torch.manual_seed(seed)
        torch.randn(100)  # the init, alike everywhere
        seed_dropout(seed, Processes(rank, world, "cpu"))
        for _ in range(draws):
            torch.rand(50)
        states.append(torch.get_rng_state())
    return states


def _checkpoint(states: list[torch.Tensor], monkeypatch) -> dict:
    """state.json's "rng" as rank 0 writes it, with each rank's CPU state in place of the gathered ones."""
    from gptlab.train import rng

    monkeypatch.setattr(Processes, "gather", lambda self, value: [{"torch": rng._b64(s)} for s in states])
    return rng_state(Processes(0, len(states), "cpu"))


def test_ranks_draw_their_own_dropout_masks() -> None:
    """The bug: every rank seeded alike for the init kept the same stream, hence the same dropout masks."""
    masks = []
    for rank in range(3):
        torch.manual_seed(7)
        seed_dropout(7, Processes(rank, 3, "cpu"))
        masks.append(torch.nn.functional.dropout(torch.ones(1000), 0.5))
    torch.manual_seed(7)  # rank 0 keeps the stream it has: one process draws as it always did
    assert torch.equal(masks[0], torch.nn.functional.dropout(torch.ones(1000), 0.5))
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def test_resume_puts_back_each_ranks_stream_on_2_processes_and_on_1(monkeypatch) -> None:
    saved = _cpu_rank_states(7, 2)
    state = _checkpoint(saved, monkeypatch)
    assert len(state["ranks"]) == 2 and "torch" in state["ranks"][1]  # rank 1's own CPU state
    for rank in (0, 1):  # the same number of processes: each its own stream, exactly
        torch.manual_seed(0)
        restore_rng_state(state, Processes(rank, 2, "cpu"), seed=7, step=10)
        assert torch.equal(torch.get_rng_state(), saved[rank])
    torch.manual_seed(0)  # 2 -> 1: the single process continues rank 0's stream
    restore_rng_state(state, Processes(0, 1, "cpu"), seed=7, step=10)
    assert torch.equal(torch.get_rng_state(), saved[0])


def test_resume_on_more_processes_seeds_the_new_ranks(monkeypatch) -> None:
    (saved,) = _cpu_rank_states(7, 1)
    state = _checkpoint([saved], monkeypatch)
    restore_rng_state(state, Processes(0, 2, "cpu"), seed=7, step=10)
    assert torch.equal(torch.get_rng_state(), saved)
    restore_rng_state(state, Processes(1, 2, "cpu"), seed=7, step=10)  # none saved: its own, from (seed, rank, step)
    rank1 = torch.get_rng_state()
    torch.manual_seed(rank_seed(7, 1, 10))
    assert torch.equal(rank1, torch.get_rng_state()) and not torch.equal(rank1, saved)
    assert len({rank_seed(7, r, s) for r in range(4) for s in range(4)}) == 16


@pytest.fixture
def gpus(monkeypatch):
    """`count` fake GPUs, each with a 16-byte RNG state; torch's set_rng_state_all fails as it does (2.13) when
    given more states than there are GPUs."""
    fake = types.SimpleNamespace(count=1, states={}, seeds={}, current=0)

    def check(index: int) -> int:
        if index >= fake.count:
            raise IndexError("tuple index out of range")  # torch's default_generators[i]
        return index

    def set_state(state: torch.Tensor, device: torch.device | int = "cuda") -> None:
        fake.states[check(torch.device(device).index or 0)] = bytes(state.numpy())

    def set_all(states: list[torch.Tensor]) -> None:
        for i, s in enumerate(states):
            set_state(s, torch.device("cuda", i))

    def get_state(device: torch.device | int = "cuda") -> torch.Tensor:
        index = check(torch.device(device).index or 0)
        return torch.frombuffer(bytearray(fake.states.get(index, bytes(16))), dtype=torch.uint8)

    @contextlib.contextmanager
    def device(d: torch.device):
        fake.current = check(torch.device(d).index or 0)
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [get_state(i) for i in range(fake.count)])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: fake.seeds.__setitem__(fake.current, s))
    return fake


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def test_an_8_gpu_checkpoint_resumes_on_1_gpu(gpus) -> None:
    """The bug: the checkpoint held one CUDA state per visible GPU (8), and set_rng_state_all put them back on 1:
    IndexError. A checkpoint from then is still read: rank 0 takes its own GPU's state."""
    old = {"torch": _b64(bytes(torch.get_rng_state().numpy())), "cuda": [_b64(bytes([i]) * 16) for i in range(8)]}
    restore_rng_state(old, Processes(0, 1, "cuda:0"), seed=7, step=10)
    assert gpus.states == {0: bytes([0]) * 16}
    restore_rng_state(old, Processes(1, 2, "cuda:0"), seed=7, step=10)  # rank 1 of it: a stream of its own
    assert gpus.seeds == {0: rank_seed(7, 1, 10)}


def test_cuda_states_are_saved_per_rank_and_put_back_where_the_gpu_exists(gpus, monkeypatch) -> None:
    gpus.count = 8
    own = {f"cuda:{r}": _b64(bytes([r]) * 16) for r in range(8)}
    cpu = _b64(bytes(torch.get_rng_state().numpy()))
    # 8 ranks on 8 GPUs: each saves its own GPU's state (and one CPU state: they are alike on GPUs)
    monkeypatch.setattr(Processes, "gather", lambda self, value: [{"torch": cpu, "cuda": own[f"cuda:{r}"]}
                                                                  for r in range(8)])
    gpus.states = {r: bytes([r]) * 16 for r in range(8)}
    state = rng_state(Processes(0, 8, "cuda:0"))
    assert state == {"torch": cpu, "ranks": [{"cuda": own[f"cuda:{r}"]} for r in range(8)]}
    # resumed on 4 processes of one 4-GPU node; then on 2 nodes of 2 (local rank 1 of rank 3 is cuda:1)
    gpus.count, gpus.states = 4, {}
    for rank in range(4):
        restore_rng_state(state, Processes(rank, 4, f"cuda:{rank}"), seed=7, step=10)
    assert gpus.states == {r: bytes([r]) * 16 for r in range(4)}
    restore_rng_state(state, Processes(3, 4, "cuda:1"), seed=7, step=10)
    assert gpus.states[1] == bytes([3]) * 16
    # resumed on more processes than were saved: the new ranks are seeded apart
    gpus.count, gpus.states = 16, {}
    restore_rng_state(state, Processes(12, 16, "cuda:12"), seed=7, step=10)
    assert gpus.states == {} and gpus.seeds == {12: rank_seed(7, 12, 10)}


def test_own_state_reads_only_this_process_gpu(gpus) -> None:
    from gptlab.train.rng import own_state

    gpus.count, gpus.states = 2, {0: bytes([1]) * 16, 1: bytes([2]) * 16}
    assert own_state("cuda:1")["cuda"] == _b64(bytes([2]) * 16)
    assert "cuda" not in own_state("cpu")


def test_only_a_collective_that_lost_its_peers_becomes_a_one_line_error() -> None:
    """gloo's words for a peer gone (its socket closed, the timeout) and torch's DistError become one line saying
    another process ended; any other RuntimeError, and any error of a process alone, stays what it is (a bug)."""
    two, one = Processes(1, 2, "cpu"), Processes(0, 1, "cpu")
    gone = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:7089. This is typically caused by a remote worker crashing. GLHF!")
    with pytest.raises(GptlabError) as e, two.peers_lost_as_errors():
        raise gone
    assert str(e.value) == ("process 1 of 2: another process of this run ended or stopped answering (Connection "
                            "closed by peer [127.0.0.1]:7089); this one stops too (the other's own error, if any, "
                            "says why)")
    with pytest.raises(GptlabError, match=r"answering \(NCCL watchdog timeout\)"), two.peers_lost_as_errors():
        raise dist.DistBackendError("NCCL watchdog timeout")
    for procs, error in ((two, RuntimeError("shape mismatch")), (one, gone)):
        with pytest.raises(RuntimeError) as raised, procs.peers_lost_as_errors():
            raise error
        assert raised.value is error


def test_processes_that_do_not_meet_in_time_stop_with_one_line(monkeypatch) -> None:
    """A peer that starts later than distributed_timeout after the others (a node still building its kernels) or
    cannot be reached: joining the group fails with one line naming the timeout, not an internal error."""
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    errors = [dist.DistStoreError("wait timeout after 1000ms, keys: /default_pg/0//cpu//0/1"),
              RuntimeError("Gloo connectFullMesh failed with [/x/gloo/transport/tcp/pair.cc:152] timed out "
                           "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:19876")]
    for error in errors:
        def init(backend: str, _error: Exception = error, **options) -> None:
            raise _error

        monkeypatch.setattr(dist, "init_process_group", init)
        with pytest.raises(GptlabError, match=r"^process 0 of 2 did not meet the others within distributed_timeout "
                                              r"\(1 s\) \((wait timeout|Gloo connectFullMesh)"):
            init_distributed("cpu", 1.0)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **options: (_ for _ in ()).throw(
        RuntimeError("something else")))
    with pytest.raises(RuntimeError, match="something else"):
        init_distributed("cpu", 1.0)
