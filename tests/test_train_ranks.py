"""Work split between the processes of a run instead of repeated on each: Muon's Newton-Schulz (each process
orthogonalizes its own matrices, one all_gather shares them) and the validation windows (each process scores its
own, one all-reduce sums them). On a CPU: torch's fake process group plays rank r of many (who does what), and
two gloo processes spawned here check the numbers against one process. The torchrun runs are in test_train.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptlab.config import GPTConfig
from gptlab.evaluation.loss import default_batch_size, evaluate_loss, window_share
from gptlab.model import GPT
from gptlab.train import muon
from gptlab.train.muon import BatchedMuon, matrix_owners, newton_schulz_cost, split_torch_muon
from gptlab.train.optim import OptimizerSpec, build_optimizers

# small matrices (one stack, zero-padded to 16 x 64), and 384 x 384 ones above PAD_MAX_ELEMENTS (a stack by shape)
SHAPES = [(48, 16), (16, 16), (64, 16), (16, 64), (48, 16), (16, 16), (12, 40), (384, 384), (384, 384)]
GPT2 = [(768, 2304), (768, 768), (3072, 768), (768, 3072)] * 12  # GPT-2 124M's matrices, block by block


@pytest.fixture
def fake_rank():
    """join(rank, world): this process plays `rank` of `world` in torch's fake process group (all_gather hands back
    copies of this process's own buffer)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


# --- P7: Muon's Newton-Schulz split over processes ----------------------------------------------------------
def test_matrix_owners_are_balanced_and_the_same_on_every_process() -> None:
    costs = [newton_schulz_cost(*s) for s in GPT2]
    assert matrix_owners(costs, 1) == [0] * len(costs)
    for world in range(2, 9):
        owners = matrix_owners(costs, world)
        assert owners == matrix_owners(list(costs), world)  # a pure function of the shapes: alike everywhere
        assert set(owners) == set(range(world))  # every process works
        load = [sum(c for c, r in zip(costs, owners, strict=True) if r == rank) for rank in range(world)]
        assert max(load) - min(load) <= max(costs), (world, load)  # within one matrix of each other
    # more processes than matrices: one each, the rest idle
    assert sorted(matrix_owners([5, 3, 9], 8)) == [0, 1, 2]


def _count_newton_schulz(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the matrices orthogonalized, by shape: gptlab's batched calls (each matrix of a stack at the stack's
    padded shape) and torch's one-by-one ones."""
    seen: Counter = Counter()
    batched, single = muon.newton_schulz, torch.optim._muon._zeropower_via_newtonschulz

    def count_batched(g: torch.Tensor, *args) -> torch.Tensor:
        seen["matrices"] += g.size(0)
        return batched(g, *args)

    def count_single(g: torch.Tensor, *args) -> torch.Tensor:
        seen["matrices"] += 1
        return single(g, *args)

    monkeypatch.setattr(muon, "newton_schulz", count_batched)
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", count_single)
    return seen


@pytest.mark.parametrize("impl", ["gptlab", "torch"])
def test_each_process_orthogonalizes_only_its_own_matrices(impl: str, monkeypatch, fake_rank) -> None:
    """Rank r of 4 runs Newton-Schulz on the matrices matrix_owners gives it, and on no other; one process on
    all. Before the split every process ran it on all 12 matrices."""
    model = GPT(GPTConfig.preset("tiny", n_layer=3, n_embd=32, n_head=2, n_kv_head=2, block_size=8, vocab_size=40))
    matrices = [p for _, p in model.parameter_groups_by_kind()["matrix"]]
    assert len(matrices) == 12
    seen = _count_newton_schulz(monkeypatch)
    counts = []
    for rank, world in [(0, 1), *((r, 4) for r in range(4))]:
        fake_rank(rank, world)
        (opt, _) = build_optimizers(model, OptimizerSpec(kind="muon", impl=impl), rank=rank, world=world)
        assert type(opt).__name__ == ("BatchedMuon" if impl == "gptlab" else "Muon")  # as checkpoints name it
        for p in matrices:
            p.grad = torch.randn_like(p)
        seen.clear()
        opt.step()
        counts.append(seen["matrices"])
    assert counts == [12, 3, 3, 3, 3]


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], n: int = 3) -> list[torch.Tensor]:
    """`n` steps on the same gradients everywhere (seeded), then the weights and momentum buffers."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params] + [opt.state[p]["momentum_buffer"].clone() for p in params]


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _optimizers(params: list[torch.Tensor], rank: int, world: int) -> dict[str, torch.optim.Optimizer]:
    kwargs = dict(lr=0.03, momentum=0.85, weight_decay=0.01)
    return {"gptlab": BatchedMuon(params, **kwargs, rank=rank, world=world),
            "torch": split_torch_muon()(params, **kwargs, adjust_lr_fn="original", rank=rank, world=world)}


def test_split_torch_muon_is_torch_muon() -> None:
    """Alone, the split step is torch.optim.Muon's own, bit for bit (it restates torch's loop: this pins it)."""
    ours, theirs = _params(), _params()
    (split,) = [o for k, o in _optimizers(ours, 0, 1).items() if k == "torch"]
    reference = torch.optim.Muon(theirs, lr=0.03, momentum=0.85, weight_decay=0.01, adjust_lr_fn="original")
    for a, b in zip(_steps(split, ours), _steps(reference, theirs), strict=True):
        assert torch.equal(a, b)


def _two_processes(rank: int, store: str, expected: dict[str, list[torch.Tensor]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        for impl, want in expected.items():
            params = _params()
            got = _steps(_optimizers(params, rank, 2)[impl], params)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), impl
        # both ranks done with every collective before either tears gloo down: a rank that destroyed its group
        # while the other's last all_gather was in flight aborted ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_split_muon_on_two_gloo_processes_is_one_process_muon(tmp_path: Path) -> None:
    """Two processes, each orthogonalizing its own matrices and gathering the others', end with the weights and
    buffers of one process, bit for bit, for both implementations. Bitwise because each matrix goes through the
    same operations at the same padded shape as alone (only a stack's batch count differs, which a CPU's batched
    matmul computes matrix by matrix), and the all_gather moves bf16 bits without arithmetic."""
    expected = {}
    for impl in ("gptlab", "torch"):
        params = _params()
        expected[impl] = _steps(_optimizers(params, 0, 1)[impl], params)
    mp.spawn(_two_processes, args=(str(tmp_path / "store"), expected), nprocs=2)


# --- P8: the validation windows split over processes --------------------------------------------------------
@pytest.mark.parametrize("world", range(1, 9))
def test_window_shares_are_disjoint_and_cover_every_window_once(world: int) -> None:
    for n in [*range(0, 30), 1000, 1001]:
        shares = [window_share(n, rank, world) for rank in range(world)]
        assert [w for share in shares for w in share] == list(range(n))  # in order: disjoint, every one once
        sizes = [len(share) for share in shares]
        assert max(sizes) - min(sizes) <= 1


class Recorder(torch.nn.Module):
    """The model, recording each forward's input rows; scored ones go through without the model's id checks (so
    that only evaluate_loss's own host reads are counted where that matters)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model, self.rows, self.calls = model, [], 0

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, **kwargs) -> tuple:
        self.calls += 1
        if y is not None:
            self.rows += [tuple(r.tolist()) for r in x]
        return self.model(x, y, check_ids=False, **kwargs)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_each_process_scores_only_its_windows_and_all_run_as_many_forwards(packed: bool, fake_rank) -> None:
    """Rank r of 1..8 scores its own windows (9 of them: 8 full and a shorter last one; packed: 9 windows with a
    loss mask), every window once over all ranks, each rank running as many forwards (an FSDP model gathers its
    weights in each); the ranks' sums (the fake group's all-reduce is a no-op: each returns its own) add up to
    one process's loss."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=50))
    data = np.random.default_rng(0).integers(0, 50, 9 * 20 if packed else 8 * 16 + 6).astype(np.uint16)
    mask = (np.arange(len(data)) % 3 != 0).astype(np.uint8) if packed else None
    kwargs = dict(batch_size=2, mask=mask, window_tokens=20 if packed else None)
    alone = evaluate_loss(model, data, 16, **kwargs)
    everyone = Recorder(model)
    evaluate_loss(everyone, data, 16, **kwargs)
    assert len(everyone.rows) == 9
    for world in range(2, 9):
        rows, calls, total, tokens = [], set(), 0.0, 0
        for rank in range(world):
            fake_rank(rank, world)
            recorder = Recorder(model)
            part = evaluate_loss(recorder, data, 16, **kwargs, rank=rank, world=world)
            rows += recorder.rows
            calls.add(recorder.calls)
            total, tokens = total + part.loss * part.tokens, tokens + part.tokens
        assert sorted(rows) == sorted(everyone.rows), world  # every window once
        assert len(calls) == 1, world  # lockstep
        assert tokens == alone.tokens and total / tokens == pytest.approx(alone.loss, rel=1e-6)


def test_default_eval_batch_grows_with_a_gpus_free_memory() -> None:
    """The fp32 logits of a forward stay under 512 MB, or on a CUDA GPU under a quarter of its free memory: GPT-2
    on an H100 with 60 GB free scores 64 windows of 1024 per forward, not 2. CPUs keep their 4k tokens."""
    assert default_batch_size(1024, 50257, "cuda") == 2
    assert default_batch_size(1024, 50257, "cuda", free_memory=1 << 30) == 2  # never below the 512 MB of before
    assert default_batch_size(1024, 50257, "cuda", free_memory=60 << 30) == 64  # 65536 tokens: the cap
    assert default_batch_size(1024, 50257, "cuda", free_memory=16 << 30) == 20
    assert default_batch_size(64, 65, "cpu", free_memory=60 << 30) == default_batch_size(64, 65, "cpu") == 64
    assert default_batch_size(1024, 50257, "mps", free_memory=60 << 30) == 2
