"""Prompts prefilled together (`generation/prefill.py`): into any rows of the cache, checked against full forwards
without a cache, and in the engine and the server's scheduler against each prompt alone."""

from __future__ import annotations

import pytest
import torch
from families import VOCAB
from families import build as family_model
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import gptlab.generation.engine as engine_module
import gptlab.generation.engine_prefill as prefill_module
from gptlab.config import RopeScaling
from gptlab.generation import Engine, SamplingParams, generate_batch
from gptlab.generation.prefill import PADDING_WASTE, padded_groups, prefill_rows
from gptlab.generation.prefix_cache import PrefixCache
from gptlab.kv_cache import KVCache
from gptlab.rope import rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
_MODELS = {"rope": tiny_model(seed=5), "learned": tiny_model("learned", seed=6),
           "window": tiny_model(seed=7, sliding_window=6)}


def tokens(seed: int, n: int) -> list[int]:
    return [(31 * seed + 7 * j) % 256 for j in range(n)]


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(sorted(_MODELS)), held=st.lists(st.integers(0, 20), min_size=1, max_size=4),
       fed=st.data())
def test_rows_fed_together_equal_full_forwards(kind, held, fed):
    """Rows holding different numbers of tokens, fed parts of different lengths in one forward, in an order other
    than the cache's: each row's hidden states are those of a forward over its whole sequence without a cache, and
    a row not fed is left as it was."""
    model = _MODELS[kind]
    parts = [tokens(i + 50, fed.draw(st.integers(1, 12))) for i in range(len(held))]
    cache = KVCache(model.config, len(held) + 1, 40)
    slots = list(range(len(held), 0, -1))  # rows n..1, row 0 stays out
    with torch.inference_mode():
        prefill_rows(model, cache, [0], [tokens(99, 5)])
        before = cache.k[:, 0].clone()
        for slot, n in zip(slots, held, strict=True):
            if n:
                prefill_rows(model, cache, [slot], [tokens(slot, n)])
        hidden = prefill_rows(model, cache, slots, parts)
        for i, (slot, n, part) in enumerate(zip(slots, held, parts, strict=True)):
            whole = model.hidden_states(torch.tensor([tokens(slot, n) + part]))[0, n:]
            torch.testing.assert_close(hidden[i, : len(part)], whole, atol=1e-5, rtol=1e-5)
            assert int(cache.lengths[slot]) == n + len(part)
    assert torch.equal(cache.k[:, 0], before) and int(cache.lengths[0]) == 5


def test_a_cache_stored_narrower_than_it_is_attended_in_gives_the_wide_caches_bits() -> None:
    """A bf16 model's keys stored in bf16 and attended in fp32 (the C++ step's cache): its row views and gathered
    rows hand attention fp32 keys too, and prefilling through them gives an fp32 cache's bits."""
    model = tiny_model(seed=5).to(torch.bfloat16)
    out = {}
    for stored in (torch.float32, torch.bfloat16):
        cache = KVCache(model.config, 3, 40, dtype=stored, attend_dtype=torch.float32)
        assert cache.rows(1, 2).attend_dtype == cache.gather(torch.tensor([2, 0]), 16).attend_dtype == torch.float32
        with torch.inference_mode():
            prefill_rows(model, cache, [2], [tokens(1, 9)])
            out[stored] = prefill_rows(model, cache, [0, 2], [tokens(2, 7), tokens(3, 4)])
        assert cache.k.dtype == stored
    assert torch.equal(out[torch.float32], out[torch.bfloat16])


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.integers(1, 300), min_size=1, max_size=16), data=st.data())
def test_padded_groups_take_each_row_once_and_bound_the_padding(parts, data):
    held = data.draw(st.lists(st.integers(0, 200), min_size=len(parts), max_size=len(parts)))
    max_len = max(h + p for h, p in zip(held, parts, strict=True))
    unpadded = data.draw(st.booleans())
    groups = padded_groups(parts, held, max_len, unpadded=unpadded)
    assert sorted(i for g in groups for i in g) == list(range(len(parts)))
    for g in groups:
        longest = max(parts[i] for i in g)
        assert not unpadded or all(parts[i] == longest for i in g)
        assert len(g) == 1 or len(g) * longest <= PADDING_WASTE * sum(parts[i] for i in g)
        assert max(held[i] for i in g) + longest <= max_len


def test_padded_groups_unpadded_puts_only_parts_of_one_length_together():
    groups = padded_groups([5, 3, 5, 3, 4], [0, 2, 1, 0, 0], 20, unpadded=True)
    assert sorted(sorted(g) for g in groups) == [[0, 2], [1, 3], [4]]


LENGTH_DEPENDENT_SCALINGS = {
    "dynamic": RopeScaling("dynamic", factor=2.0, original_context=16),
    "longrope": RopeScaling("longrope", original_context=16, short_factor=(1.0,) * 8,
                            long_factor=(2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)),
}


@pytest.mark.parametrize("scaling", sorted(LENGTH_DEPENDENT_SCALINGS))
def test_length_dependent_rope_tables_of_rows_are_each_rows_own(scaling):
    """Rows of their own positions (a batch of separate sequences): each row's cos and sin are those of that row
    alone, whatever the other rows' lengths."""
    config = family_model("llama", rope_scaling=LENGTH_DEPENDENT_SCALINGS[scaling]).config
    pos = torch.tensor([[3], [40], [15]])
    cos, sin = rope_tables(config, pos)
    for b in range(3):
        alone = rope_tables(config, pos[b : b + 1])
        assert torch.equal(cos[b : b + 1], alone[0]) and torch.equal(sin[b : b + 1], alone[1])


@pytest.mark.parametrize("step", ["plain", "lean"])
@pytest.mark.parametrize("scaling", sorted(LENGTH_DEPENDENT_SCALINGS))
def test_a_row_of_a_length_dependent_rope_model_answers_as_alone_beside_longer_rows(monkeypatch, scaling, step):
    """Dynamic NTK and longrope switch frequencies once a sequence passes the pretraining context (16 here). A row
    that stays within it, prefilled in one forward with a row past it and decoding beside it, keeps the
    frequencies it has alone: its tokens are the full forwards' argmax; the longer row's are its own alone."""
    monkeypatch.setenv("GPTLAB_KERNEL", "torch")
    if step == "plain":
        monkeypatch.setattr(engine_module, "lean_step_exact", lambda m: False)
    model = family_model("llama", rope_scaling=LENGTH_DEPENDENT_SCALINGS[scaling])
    short, long = ([t % VOCAB for t in tokens(seed, n)] for seed, n in ((3, 4), (4, 30)))
    params = SamplingParams(temperature=0, max_new_tokens=10)
    for staggered in (False, True):
        engine = Engine(model, max_batch=2)
        assert engine.kernels()["decode step"] == step
        gens = [engine.prepare(long, params), engine.prepare(short, params)]
        if staggered:  # the short row prefilled alone, then decoding beside the long one
            engine.add(gens[1:])
            engine.add(gens[:1])
        else:  # both prefilled in one forward
            engine.add(gens)
        while engine.running:
            engine.step()
        context, want = list(short), []
        with torch.no_grad():
            for _ in range(10):
                want.append(int(model(torch.tensor([context])).logits[0, -1].argmax()))
                context.append(want[-1])
        assert gens[1].token_ids == want
        assert gens[0].token_ids == generate_batch(model, [long], params)[0].token_ids


@pytest.mark.parametrize("scaling", sorted(LENGTH_DEPENDENT_SCALINGS))
def test_chunked_prefill_of_a_length_dependent_rope_model_equals_whole_prefill(scaling):
    """A prompt past the pretraining context (30 tokens, 16) with prefill_chunk 7, alone and while another row
    decodes: the tokens and logprobs (prompt's too) of its one whole forward; one within it is still chunked."""
    model = family_model("llama", rope_scaling=LENGTH_DEPENDENT_SCALINGS[scaling])
    params = SamplingParams(temperature=0, max_new_tokens=8, logprobs=1, prompt_logprobs=True)
    short, long = ([t % VOCAB for t in tokens(seed, n)] for seed, n in ((5, 12), (6, 30)))
    whole = [generate_batch(model, [p], params)[0] for p in (short, long)]
    for beside in (False, True):
        engine = Engine(model, max_batch=3, prefill_chunk=7)
        if beside:
            engine.add([engine.prepare([1, 2, 3], params)])
        gens = [engine.prepare(p, params) for p in (short, long)]
        for g in gens:
            engine.add([g])
            assert len(g.row.pending) == (12 - 7 if g is gens[0] else 0)  # its first chunk; the long one whole
            while not g.token_ids:
                engine.step()
        while engine.running:
            engine.step()
        for a, b in zip(whole, gens, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor([e.logprob for e in b.logprobs + b.prompt_logprobs[1:]]),
                                       torch.tensor([e.logprob for e in a.logprobs + a.prompt_logprobs[1:]]))


def test_rows_that_join_together_in_scattered_slots_answer_as_alone(monkeypatch):
    """Rows freed here and there are filled by one prefill forward (where the decode step does not take them); every
    row answers as it would alone."""
    model = _MODELS["rope"]
    monkeypatch.setattr(Engine, "_rows_step_ready", lambda self: False)
    forwards = []
    monkeypatch.setattr(prefill_module, "prefill_rows",
                        lambda m, c, slots, parts: forwards.append(list(slots)) or prefill_rows(m, c, slots, parts))
    engine = Engine(model, max_batch=5)
    first = [engine.prepare(tokens(i, 3 + i), SamplingParams(temperature=0, max_new_tokens=n))
             for i, n in enumerate([20, 2, 20, 3, 20])]
    engine.add(first)
    while not (first[1].finished and first[3].finished):
        engine.step()
    assert [g is None for g in engine.slots] == [False, True, False, True, False]
    later = [engine.prepare(tokens(10 + i, 4 + 3 * i), GREEDY) for i in range(2)]
    forwards.clear()
    engine.add(later)
    assert [sorted(f) for f in forwards] == [[1, 3]]  # one forward into the two scattered free rows
    while engine.running:
        engine.step()
    alone = [generate_batch(model, [g.prompt_ids], g.params)[0].token_ids for g in first + later]
    assert [g.token_ids for g in first + later] == alone


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("kind", sorted(_MODELS))
def test_prompts_added_while_rows_decode_go_into_the_next_c_step(on_kernel, monkeypatch, kind: str, chunk):  # noqa: ANN001
    """On the C++ step, prompts added while other rows decode (a one-token prompt, prompts longer than a chunk,
    rows restored from the prefix cache, a row scoring its prompt) take no forward of their own: the next steps' C++
    calls feed them as more rows. Every row gets the tokens and logprobs of the separate prefill forwards."""
    model = _MODELS[kind]
    calls = {"rows": 0, "prefill": 0}
    real_rows, real_prefill = prefill_module.decode_rows, prefill_module.prefill_rows
    monkeypatch.setattr(prefill_module, "decode_rows",
                        lambda *a: calls.__setitem__("rows", calls["rows"] + 1) or real_rows(*a))
    monkeypatch.setattr(prefill_module, "prefill_rows",
                        lambda *a: calls.__setitem__("prefill", calls["prefill"] + 1) or real_prefill(*a))
    scoring = SamplingParams(temperature=0, max_new_tokens=12, prompt_logprobs=True, logprobs=1)

    def run(rows_step: bool) -> list:
        engine = Engine(model, max_batch=5, prefill_chunk=chunk, prefix_cache=PrefixCache(1 << 24, block_tokens=4))
        assert engine.kernels()["decode step"] == "native C++"
        if not rows_step:
            monkeypatch.setattr(engine, "_rows_step_ready", lambda: False)
        first = [engine.prepare(tokens(i, 3 + 4 * i), GREEDY) for i in range(2)]
        engine.add(first)
        for _ in range(3):
            engine.step()
        calls.update(rows=0, prefill=0)
        later = [engine.prepare(tokens(1, 7) + [5], GREEDY), engine.prepare([42], GREEDY),
                 engine.prepare(tokens(9, 10), scoring)]  # the first begins as a finished row's prompt did
        engine.add(later)
        while engine.running:
            engine.step()
        return [(g.token_ids, [e.logprob for e in g.prompt_logprobs[1:]]) for g in first + later]

    together = run(True)
    assert calls["rows"] > 0 and calls["prefill"] == 0
    alone = run(False)
    assert calls["rows"] == 0 and calls["prefill"] > 0
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(together, alone, strict=True):
        assert tokens_a == tokens_b and logprobs_a == pytest.approx(logprobs_b, abs=1e-5)


def test_a_step_of_many_rows_prefills_by_the_plain_forward_where_pytorch_wins_there(on_kernel, monkeypatch):  # noqa: ANN001
    """Where the dispatch measured PyTorch's products faster at its large-batch size, a step that would feed that
    many rows leaves its prompts to the plain forward (as a prefill's forward keeps PyTorch's products there); a
    step of fewer rows still takes them."""
    from gptlab.kernels.dispatch import BATCH

    model = _MODELS["rope"]
    calls = []
    real_rows, real_prefill = prefill_module.decode_rows, prefill_module.prefill_rows
    monkeypatch.setattr(prefill_module, "decode_rows", lambda *a: calls.append("rows") or real_rows(*a))
    monkeypatch.setattr(prefill_module, "prefill_rows", lambda *a: calls.append("plain") or real_prefill(*a))
    monkeypatch.setattr(prefill_module, "chosen_ops", lambda kind, rows: None)  # PyTorch wins at many rows
    engine = Engine(model, max_batch=3)
    engine.add([engine.prepare(tokens(1, 4), GREEDY)])
    engine.step()
    for n, path in ((BATCH + 3, "plain"), (5, "rows")):
        calls.clear()
        g = engine.prepare(tokens(2, n), GREEDY)
        engine.add([g])
        engine.step()
        assert calls[:1] == [path] and g.token_ids, n
        engine.release(g)


def test_with_the_prefix_cache_and_prompt_logprobs_rows_together_answer_as_alone():
    """Rows restored from the prefix cache (each holding a different kept length) and rows scoring their prompt,
    prefilled together in chunks, get the tokens and logprobs each gets alone without the cache."""
    model = _MODELS["rope"]
    shared = tokens(3, 24)
    prompts = [shared + tokens(4, 5), shared[:16] + tokens(5, 9), tokens(6, 30), shared + tokens(7, 2)]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0, max_new_tokens=12, prompt_logprobs=True, logprobs=1),
              SamplingParams(temperature=0.9, seed=4, max_new_tokens=12)]
    engine = Engine(model, max_batch=4, prefill_chunk=7, prefix_cache=PrefixCache(1 << 24, block_tokens=8))
    engine.run([engine.prepare(shared + [1], GREEDY)])  # the shared beginning kept
    together = engine.run([engine.prepare(p, sp) for p, sp in zip(prompts, params, strict=True)])
    assert engine.prefix_cache.stats().hit_tokens > 0
    for g, p, sp in zip(together, prompts, params, strict=True):
        (alone,) = generate_batch(model, [p], sp)
        assert g.token_ids == alone.token_ids
        assert [e.logprob for e in g.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in alone.prompt_logprobs[1:]], abs=1e-5)


def test_a_prefill_that_fails_fails_its_row_alone(monkeypatch):
    """One prompt whose forward fails, admitted with others: it finishes with its error, the others answer as
    alone; added alone, the error is raised as before."""
    model = _MODELS["rope"]
    real = prefill_module.prefill_rows

    def failing(m, c, slots, parts):  # noqa: ANN001, ANN202
        if any(p[:1] == [13] for p in parts):
            raise RuntimeError("boom")
        return real(m, c, slots, parts)

    monkeypatch.setattr(prefill_module, "prefill_rows", failing)
    engine = Engine(model, max_batch=3)
    gens = [engine.prepare(p, GREEDY) for p in ([5, 6, 7], [13, 1, 2], [9, 8])]
    engine.add(gens)
    assert gens[1].finish_reason == "error" and "boom" in str(gens[1].error) and engine.slots[1] is None
    while engine.running:
        engine.step()
    for g in (gens[0], gens[2]):
        assert g.token_ids == generate_batch(model, [g.prompt_ids], GREEDY)[0].token_ids
    with pytest.raises(RuntimeError, match="boom"):
        engine.add([engine.prepare([13, 4], GREEDY)])


def _schedule(engine: Engine, prompts: list[list[int]], loop=None) -> list:  # noqa: ANN001
    """Jobs of `prompts` submitted together to a server's scheduler over `engine`, run until they finish; its
    events go to `loop` (default: a loop that never runs, where they just queue)."""
    import asyncio
    import time

    from gptlab.serve.scheduler import Job, Scheduler

    own = loop is None
    loop = asyncio.new_event_loop() if own else loop
    try:
        jobs = [Job([engine.prepare(p, GREEDY)], loop=loop) for p in prompts]
        scheduler = Scheduler(engine)
        for job in jobs:
            scheduler.submit(job)
        scheduler.start()
        deadline = time.monotonic() + 60
        while not all(job.gens[0].finished for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.01)
        scheduler.stop()
    finally:
        loop.close()
    return jobs


def test_rows_whose_event_loop_closed_are_freed():
    """A job whose event loop is gone (a server shutting down) has nobody to answer: its rows are freed at the
    next step instead of decoding to their end."""
    import asyncio
    import time

    from helpers import ByteTokenizer

    from gptlab.serve.scheduler import Job, Scheduler

    engine = Engine(_MODELS["rope"], max_batch=2, tokenizer=ByteTokenizer())  # text: each step has events
    loop = asyncio.new_event_loop()
    loop.close()
    job = Job([engine.prepare(tokens(3, 4), SamplingParams(max_new_tokens=40, temperature=0))], loop=loop)
    scheduler = Scheduler(engine)
    scheduler.submit(job)
    scheduler.start()
    try:
        deadline = time.monotonic() + 60
        while (scheduler.steps == 0 or engine.running) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert job.cancelled and not engine.running and all(s is None for s in engine.slots)
    assert len(job.gens[0].token_ids) < 40 and scheduler.steps < 39


def test_the_scheduler_admits_waiting_requests_in_one_prefill():
    """Requests waiting when the server's scheduler looks are prefilled by one `Engine.add`, and each answers
    as alone."""
    model = _MODELS["rope"]
    engine = Engine(model, max_batch=4)
    added, real_add = [], engine.add
    engine.add = lambda gens: added.append(len(gens)) or real_add(gens)
    jobs = _schedule(engine, [tokens(20 + i, 3 + 2 * i) for i in range(3)])
    assert added == [3]
    for job in jobs:
        assert job.gens[0].token_ids == generate_batch(model, [job.gens[0].prompt_ids], GREEDY)[0].token_ids


def test_first_tokens_a_prefill_sampled_go_out_before_the_next_step():
    """Rows admitted while nothing else decodes sample their first token in the prefill; the scheduler hands
    those to the event loop at once, not after the decode step that follows (a step's wait off time to first
    token)."""
    import asyncio

    from gptlab.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text("".join(chr(0x100 + i) for i in range(256)))  # a character a token: text at once
    engine = Engine(_MODELS["rope"], max_batch=4, tokenizer=tok)
    order, real_step = [], engine.step
    engine.step = lambda: order.append("step") or real_step()
    loop = asyncio.new_event_loop()  # not running: what the scheduler hands over is recorded, not run
    loop.call_soon_threadsafe = lambda fn, items: order.append(sorted(event[1] != "" for _, event in items))
    _schedule(engine, [tokens(30 + i, 4) for i in range(3)], loop)
    assert order[0] == [True, True, True]  # the three first tokens, before any step
    assert order[1] == "step"
