"""Work split between the processes of a run instead of repeated on each: Muon's Newton-Schulz (each process
orthogonalizes its own matrices, one all_gather shares them) and the validation windows (each process scores its
own, one all-reduce sums them). On a CPU: torch's fake process group plays rank r of many (who does what), and
two gloo processes spawned here check the numbers against one process. The torchrun runs are in test_train.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptlab.config import GPTConfig
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
