"""FSDP on a CPU: the memory check per process (pure), building and initializing a sharded model, checkpoints
gathered to the writer alone, and the mixed-precision policy, under torch's fake process group (one process
playing rank r of many, collectives no-ops) or real 2-process gloo runs (torchrun)."""

from __future__ import annotations

import dataclasses

from gptlab.train import build_train_config
from gptlab.train.setup import parameter_counts, step_memory

GB = 1e9


# --- B3: the memory check counts what one process of an FSDP run holds -------------------------------------------
def _step_memory(model: str, T: int, world: int, **keys: object) -> int:
    """The check's bytes for `model` at block_size T, one sequence per process, one micro-step."""
    cfg = build_train_config({"model": model, "block_size": T, "batch_size": world, **keys})
    cfg = dataclasses.replace(cfg, grad_accum=1)
    return step_memory(cfg, cfg.model_config(), world, fresh=True)


def test_mistral_7b_under_fsdp_on_8_gpus_fits_in_80_gb() -> None:
    """The review's case: counted whole on every process, in fp32 activations, it was 133.6 GB and refused."""
    params = parameter_counts(build_train_config({"model": "mistral-7b"}).model_config())[0]
    assert 7.2e9 < params < 7.3e9
    sharded = _step_memory("mistral-7b", 2048, 8, distributed="fsdp", dtype="bfloat16")
    assert 16 * params / 8 < sharded < 40 * GB  # 1/8 of the states, plus the gathered root and block, activations
    recomputed = _step_memory("mistral-7b", 2048, 8, distributed="fsdp", dtype="bfloat16",
                              activation_checkpointing=True)
    assert 16 * params / 8 < recomputed < sharded - 8 * GB  # activations of one block instead of 32
    fp32 = _step_memory("mistral-7b", 2048, 8, distributed="fsdp", dtype="float32")
    assert fp32 > sharded + 8 * GB  # fp32 activations are twice bf16's
    # DDP replicates everything: 16 bytes a parameter (and the bf16 copies) on every process, as one process does
    for world in (1, 8):
        assert _step_memory("mistral-7b", 2048, world, distributed="ddp", dtype="bfloat16") > 18 * params


def test_the_memory_check_of_one_process_is_unchanged_in_kind() -> None:
    """GPT-2 (124M, tied head counted once) at T=1024, 1 sequence, fp32: 16 bytes a parameter, 4-byte activations."""
    params = parameter_counts(build_train_config({"model": "gpt2"}).model_config())[0]
    assert 124e6 < params < 125e6
    fp32 = _step_memory("gpt2", 1024, 1, dtype="float32")
    activations = 4 * 1024 * (2 * 50257 + 12 * 16 * 768)
    assert fp32 == 16 * params + activations
    # fsdp with one process is one unsharded process
    assert _step_memory("gpt2", 1024, 1, dtype="float32", distributed="fsdp") == fp32
    bf16 = _step_memory("gpt2", 1024, 1, dtype="bfloat16")
    assert bf16 == 18 * params + activations // 2
    recomputed = _step_memory("gpt2", 1024, 1, dtype="bfloat16", activation_checkpointing=True)
    assert recomputed == 18 * params + 2 * 1024 * (2 * 50257 + 12 * 768 + 16 * 768)
