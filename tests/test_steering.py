"""Steering vectors: from files and from contrasting prompts, in a forward, in `generate` and `gptlab sample
--steer`, checked against PyTorch's own module hooks (an independent way to add to a block's input)."""

from __future__ import annotations

import pytest
import torch
from families import model_of
from helpers import char_checkpoint, one_line_error, tiny_model

from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.generation import generate
from gptlab.steering import SteeringVector, direction_from_prompts, load_steering, save_direction, steered

PROMPT = torch.tensor([[5, 17, 3, 42, 8]])


def add_before_block(model, layer: int, vector: torch.Tensor):  # noqa: ANN001, ANN201
    """PyTorch's forward pre-hook adding `vector` to block `layer`'s input: the reference."""
    def pre(module, args):  # noqa: ANN001, ANN202
        return (args[0] + vector, *args[1:])
    return model.transformer.h[layer].register_forward_pre_hook(pre)


def greedy_reference(model, idx: torch.Tensor, n: int) -> torch.Tensor:  # noqa: ANN001
    """Greedy decoding by full forwards, no KV cache."""
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_steered_forward_and_generation_equal_adding_before_the_block(family: str) -> None:
    model = model_of(family)
    direction = torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(1))
    vectors = [SteeringVector(direction, 1, 3.0), SteeringVector(direction, 1, -1.0)]  # two at a layer add up
    handle = add_before_block(model, 1, 2.0 * direction)
    try:
        with torch.no_grad():
            expected, _ = model(PROMPT)
        expected_tokens = greedy_reference(model, PROMPT, 20)
    finally:
        handle.remove()
    with steered(model, vectors), torch.no_grad():
        logits, _ = model(PROMPT)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    # 20 new tokens: past PACK_MIN_TOKENS, so packed weights run too
    steered_tokens = generate(model, PROMPT, 20, temperature=0, steering=vectors)
    assert torch.equal(steered_tokens, expected_tokens)
    assert not torch.equal(steered_tokens, generate(model, PROMPT, 20, temperature=0))
    assert model.hooks is None


def test_direction_from_prompts_is_the_mean_difference_of_the_block_inputs() -> None:
    model = model_of("llama")
    positive, negative = [[1, 2, 3], [4, 5, 6, 7]], [[9, 8], [7, 7, 7]]
    seen = []
    handle = model.transformer.h[1].register_forward_pre_hook(lambda m, args: seen.append(args[0][0].mean(0)))
    try:
        with torch.no_grad():
            for p in positive + negative:
                model(torch.tensor([p]))
    finally:
        handle.remove()
    expected = torch.stack(seen[:2]).mean(0) - torch.stack(seen[2:]).mean(0)
    torch.testing.assert_close(direction_from_prompts(model, positive, negative, 1), expected)
    with pytest.raises(GptlabError, match="layer 2 is out of range"):
        direction_from_prompts(model, positive, negative, 2)


def test_files_round_trip_and_bad_ones_are_refused(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    model = model_of("gpt2")
    direction = torch.randn(model.config.n_embd)
    path = save_direction(tmp_path / "d.safetensors", direction)
    vector = load_steering(path, 0, 2.0)
    assert torch.equal(vector.direction, direction) and vector.layer == 0 and vector.scale == 2.0
    (tmp_path / "text.safetensors").write_text("not safetensors")
    with pytest.raises(GptlabError, match="not a safetensors file|truncated"):
        load_steering(tmp_path / "text.safetensors", 0)
    save_file({"a": torch.zeros(3), "b": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(GptlabError, match="one tensor"):
        load_steering(tmp_path / "two.safetensors", 0)
    save_file({"a": torch.zeros(2, 3)}, str(tmp_path / "matrix.safetensors"))
    with pytest.raises(GptlabError, match="vector"):
        load_steering(tmp_path / "matrix.safetensors", 0)
    with pytest.raises(GptlabError, match="width"):
        with steered(model, [SteeringVector(torch.zeros(3), 0)]):
            pass
    assert model.hooks is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):  # noqa: ANN001, ANN201
    return char_checkpoint(tmp_path_factory.mktemp("steer") / "ckpt")


def test_sample_steer_flag(checkpoint, tmp_path, capsys) -> None:  # noqa: ANN001
    model = tiny_model(vocab_size=28)
    direction = save_direction(tmp_path / "d.safetensors", 4.0 * torch.randn(model.config.n_embd))
    args = ["sample", str(checkpoint), "--prompt", "abc", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--steer", f"{direction}:1:3.0"]) == 0
    assert capsys.readouterr().out != plain
    for bad, message in [(f"{direction}:x:1", "FILE:LAYER:SCALE"), (f"{direction}:9:1", "out of range"),
                         (f"{tmp_path}/none.safetensors:0:1", "missing"), (f"{direction}:0:nan", "not finite"),
                         (f"{direction}:0:inf", "not finite"), (f"{direction}:0:1e39", "overflow")]:
        assert main([*args, "--steer", bad]) == 2
        assert message in one_line_error(2, capsys.readouterr().err)


@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_rows_of_one_batch_are_steered_alone_and_keep_out_of_the_prefix_cache(prefill_chunk) -> None:  # noqa: ANN001
    """Steered and unsteered rows decoded together each equal greedy decoding by full forwards with (and without)
    PyTorch's pre-hook; a steered row neither reuses nor leaves keys in the prefix cache."""
    from gptlab.generation import Engine, SamplingParams
    from gptlab.generation.prefix_cache import PrefixCache

    model = model_of("llama")
    gen = torch.Generator().manual_seed(2)
    up, down = (torch.randn(model.config.n_embd, generator=gen) for _ in range(2))
    shared = list(range(3, 23))  # 20 tokens: 5 blocks of 4
    other = [7, 1, 30, 2, 9, 11]
    vectors = {"up": [SteeringVector(up, 1, 3.0)], "down": [SteeringVector(down, 0, 2.0), SteeringVector(up, 1, -1.0)]}

    def expected(prompt: list[int], steering: list[SteeringVector]) -> list[int]:
        handles = [add_before_block(model, v.layer, v.scale * v.direction) for v in steering]
        try:
            return greedy_reference(model, torch.tensor([prompt]), 10)[0, len(prompt):].tolist()
        finally:
            for h in handles:
                h.remove()

    cache = PrefixCache(2**24, block_tokens=4)
    engine = Engine(model, max_batch=4, prefill_chunk=prefill_chunk, prefix_cache=cache)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    (plain,) = engine.run([engine.prepare(shared, params)])  # keeps the shared prompt's blocks
    assert plain.token_ids == expected(shared, [])
    blocks, hits = cache.stats().blocks, cache.stats().hit_tokens
    rows = [(shared, vectors["up"]), (shared, []), (other, vectors["down"]), (other, [])]
    gens = engine.run([engine.prepare(p, params, steering=s) for p, s in rows])
    for g, (prompt, steering) in zip(gens, rows, strict=True):
        assert g.token_ids == expected(prompt, steering), (prompt, steering)
    assert gens[0].token_ids != gens[1].token_ids
    # only the unsteered copy of the shared prompt reused its kept blocks (16 of its 20 tokens), and only unsteered
    # rows left blocks: the shared prompt's repeat holds what the first run kept, the other prompt's 15 tokens 3 new
    assert cache.stats().hit_tokens - hits == 16
    assert cache.stats().blocks == blocks + 3
    assert model.hooks is None
