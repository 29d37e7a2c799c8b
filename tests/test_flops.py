"""MFU's numerator under LoRA and QLoRA: the frozen weights' weight-gradient products do not run, the adapters' do,
counted by hand from the maths for a small model (the full-training count is test_train's)."""

from __future__ import annotations

import pytest
import torch

from gptlab.config import GPTConfig
from gptlab.flops import TrainedWeights, flops_per_token
from gptlab.lora import LoRASpec, add_lora
from gptlab.model import GPT
from gptlab.train.setup import trained_weights

# 2 layers, 4 query / 2 kv heads of 8, width 32, SwiGLU hidden 48, vocab 96, untied head; T 32
CONFIG = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu",
                   mlp_hidden=48, norm="rmsnorm", position="rope", bias=False, tie_embeddings=False)
# per layer: c_attn 32 x (32 + 16 + 16), attn.c_proj 32 x 32, c_fc 32 x (2 x 48), mlp.c_proj 48 x 32
BLOCKS = 2 * (32 * 64 + 32 * 32 + 32 * 96 + 48 * 32)
HEAD = 32 * 96
# attention forward: 4 * H * hs * T / 2 per layer (q k^T and a v over half the keys on average); 3x to train
ATTENTION = 2 * 4 * 4 * 8 * 16
# rank 2 on q (32 -> 32), v (32 -> 16) and down (48 -> 32): A is r x in, B is out x r
ADAPTERS = 2 * (2 * (32 + 32) + 2 * (32 + 16) + 2 * (48 + 32))


def test_hand_count() -> None:
    assert (BLOCKS, HEAD, ATTENTION, ADAPTERS) == (15_360, 3_072, 4_096, 768)


def test_full_training_counts_every_product_of_every_weight() -> None:
    full = 6 * (BLOCKS + HEAD) + 3 * ATTENTION
    assert flops_per_token(CONFIG, 32) == full == 122_880
    assert flops_per_token(CONFIG, 32, trained=TrainedWeights()) == full
    assert flops_per_token(CONFIG, 32, training=False) == 2 * (BLOCKS + HEAD) + ATTENTION


@pytest.mark.parametrize("head", [False, True])
def test_lora_counts_no_weight_gradient_of_frozen_weights_and_every_product_of_the_adapters(head: bool) -> None:
    # frozen: forward 2P and the input's gradient 2P; trained: 6P; attention's backward runs (gradients flow)
    want = 4 * BLOCKS + (6 if head else 4) * HEAD + 6 * ADAPTERS + 3 * ATTENTION
    lora = TrainedWeights(blocks=False, head=head, adapters=ADAPTERS)
    assert flops_per_token(CONFIG, 32, trained=lora) == want == (96_768 if head else 90_624)
    if not head:  # the old count, 6P for every weight (and none for the adapters), was 1.36x what runs
        assert flops_per_token(CONFIG, 32) / want == pytest.approx(1.356, abs=1e-3)
    # inference with unmerged adapters runs their forward too
    assert flops_per_token(CONFIG, 32, training=False, trained=lora) == 2 * (BLOCKS + HEAD + ADAPTERS) + ATTENTION


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_trainer_counts_the_model_it_trains(quantize: str | None) -> None:
    """`trained_weights` (what the trainer hands `flops_per_token`): all of a plain model; under (Q)LoRA the
    adapters alone, counted as add_lora shapes them, beside a frozen base and head."""
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    assert trained_weights(plain) == TrainedWeights()
    model = GPT(CONFIG)
    if quantize:
        from gptlab.qlora import quantize_base

        quantize_base(model, quantize)
    add_lora(model, LoRASpec(rank=2, targets=("q", "v", "down"), quantize=quantize))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == ADAPTERS
    assert trained_weights(model) == TrainedWeights(blocks=False, head=False, adapters=ADAPTERS)
    assert flops_per_token(CONFIG, 32, trained=trained_weights(model)) == 90_624
    # every linear target of a SwiGLU model: gate and up are c_fc's halves, each with its own A and B
    every = add_lora(GPT(CONFIG), LoRASpec(rank=2))
    per_layer = 2 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 48) + (48 + 32))
    assert trained_weights(every).adapters == 2 * per_layer
