"""The fixed-shape decode step a GPU captures in CUDA graphs (`gptlab.generation.graph_decode`), run uncaptured on
the CPU: it must compute what the plain forward does (attention over more keys, the extra ones masked: equal but
for the order of the sums), for every family, and read nothing back from the device. The capture itself runs in
tests/test_cuda.py on a GPU."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES
from families import build as family_model

from gptlab.config import RopeScaling
from gptlab.generation import Engine
from gptlab.generation.fast_decode import decode_hidden
from gptlab.generation.graph_decode import StaticDecode, usable
from gptlab.generation.params import SamplingParams
from gptlab.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")


def _hidden_after_steps(model: torch.nn.Module, lengths: list[int], keys: int | None, steps: int = 4) -> torch.Tensor:
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    cache = KVCache(model.config, len(lengths), 32, dtype=torch.float32)
    with torch.inference_mode():
        model.hidden_states(torch.randint(0, vocab, (len(lengths), max(lengths))), kv_cache=cache)
        cache.lengths.copy_(torch.tensor(lengths))
        out = [decode_hidden(model, torch.randint(0, vocab, (len(lengths), 1)), cache, native=None, keys=keys)
               for _ in range(steps)]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fixed_shape_step_equals_the_usual_one(family: str) -> None:
    """Rows of one length and of several, over as many keys as they need and over the whole cache (masked)."""
    model = family_model(family)
    for lengths in ([5], [7, 2, 12]):
        want = _hidden_after_steps(model, lengths, keys=None)
        for keys in (max(lengths) + 4, 32):
            got = _hidden_after_steps(model, lengths, keys=keys)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (lengths, keys)


@pytest.mark.parametrize("family", ["mistral", "llama-llama3", "gemma2"])
def test_fixed_shape_step_reads_nothing_back(family: str) -> None:
    """On the meta device (tensors without values) any read of a value into Python raises: the fixed-shape step
    never does one, where the usual step reads the rows' lengths."""
    model = family_model(family).to("meta")
    cache = KVCache(model.config, 3, 32, device="meta")
    tokens = torch.zeros(3, 1, dtype=torch.long, device="meta")
    with torch.inference_mode():
        logits = StaticDecode(model, cache, capture=False)(tokens, longest=10)
        assert logits.shape == (3, model.config.vocab_size)
        with pytest.raises((RuntimeError, NotImplementedError)):
            decode_hidden(model, tokens, cache, native=None)


def test_shapes_are_rounded_to_powers_of_two() -> None:
    model = family_model("llama")
    step = StaticDecode(model, KVCache(model.config, 6, 48), capture=False)
    assert [step.rows_for(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]  # never past the cache's rows
    assert [step.keys_for(n) for n in (1, 64, 65, 100)] == [48, 48, 48, 48]  # never past the cache's length
    step = StaticDecode(model, KVCache(model.config, 1, 1000), capture=False)
    assert [step.keys_for(n) for n in (1, 64, 65, 513, 1000)] == [64, 64, 128, 1000, 1000]


def test_models_that_read_the_sequence_length_decode_the_usual_way() -> None:
    assert usable(family_model("llama-yarn"))
    dynamic = family_model("llama", rope_scaling=RopeScaling("dynamic", factor=2.0, original_context=16))
    assert not usable(dynamic)
    assert Engine(dynamic, static_decode=True).kernels()["decode step"] != "static"


def _greedy(engine: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    gens = [engine.prepare(p, SamplingParams(max_new_tokens=new, temperature=0)) for p in prompts]
    engine.add(gens)
    while engine.running:
        engine.step()
    return [g.token_ids for g in gens]


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gptj"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_engine_with_the_fixed_shape_step_picks_the_same_tokens(family: str, chunk: int | None) -> None:
    """Three prompts of different lengths (rows rounded up to 4: one idle row), past the cache's length (a
    window slides), long prompts prefilled in chunks beside the others' decoding."""
    model = family_model(family)
    prompts = [[(7 * i + j) % 97 for j in range(n)] for i, n in enumerate((3, 11, 6))]
    static = Engine(model, 3, static_decode=True, prefill_chunk=chunk)
    assert static.kernels()["decode step"] == "static"
    assert _greedy(static, prompts, 60) == _greedy(Engine(model, 3, static_decode=False, prefill_chunk=chunk),
                                                   prompts, 60)


def test_the_compiled_fixed_shape_step_picks_the_same_tokens() -> None:
    """torch.compile of the step (what a GPU then captures): traced without a read of a device value, same tokens."""
    model = family_model("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    compiled = Engine(model, 2, static_decode=True, compile_decode=True)
    assert _greedy(compiled, prompts, 10) == _greedy(Engine(model, 2, static_decode=False), prompts, 10)


# int4 takes ~80 s of compiling on a 2-core CPU (the default suite's longest test) for the mechanism int8 covers:
# it runs with `pytest -m slow`
@pytest.mark.parametrize("mode", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_the_compiled_step_of_a_quantized_model_is_one_graph(mode: str) -> None:
    """Quantized layers choose their kernel and copy their weights on first use: the step runs once uncompiled
    first, so torch.compile traces it whole (through gptlab's C++ kernel too, where it runs them) instead of
    breaking the graph at every layer; the same tokens as the uncompiled engine."""
    from torch._dynamo.utils import counters

    from gptlab.quantize import quantize_model

    model = quantize_model(family_model("llama").eval(), mode, 32 if mode == "int4" else None)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    torch._dynamo.reset()
    counters.clear()
    got = _greedy(Engine(model, 2, static_decode=True, compile_decode=True), prompts, 10)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert got == _greedy(Engine(model, 2, static_decode=False), prompts, 10)
