"""Structured outputs' cost: constrained against unconstrained decoding, and the grammar libraries' mask cost.

1. A random model with GPT-2's tokenizer and vocabulary (default: 4 layers, width 256, so that the 50,257-wide mask
   weighs as much as it can against a step; `--layers` / `--width` for others), a 16-token prompt, `--new` tokens
   per row, sampled at temperature 1 with a seed, at batch 1 and 16. Constrained rows follow a schema that cannot end
   before `--new` tokens (an array of at least 10,000 {"name": string, "id": integer} objects: strings, numbers,
   keys and separators all take their turn), unconstrained rows ignore end-of-text: both decode the same number of
   tokens. Tokens/s = rows x new tokens / wall time of `generate_batch` (prefill included). The two alternate over
   `--rounds`; the median round counts, and the overhead (1 - constrained / unconstrained) is printed, with the
   share of constrained draws the grammar allowed as drawn (no mask computed: a random model's, 68-81% here).
   `--train-steps N` first trains the model N steps on arrays of such records: a model that has learnt the format,
   as one asked for JSON would have (100 steps: ~75-90 s here, 92-97% of its draws kept).
2. `--sampler`: `sample_next` alone over 16 rows of GPT-2-wide logits, walking one JSON document per row: free
   rows, constrained rows whose logits favour the document's next token (a model that follows its schema: the
   free draw is allowed, no mask is computed) and constrained rows with random logits (nearly every draw is
   forbidden and drawn again under a mask: the worst case): milliseconds per step, medians.
3. `--libraries`: the per-token mask cost of each grammar library installed (llguidance, which gptlab uses;
   xgrammar and outlines-core if present: `pip install xgrammar outlines-core`), on the same schema and GPT-2
   vocabulary, walking one 40-token JSON document: median and mean microseconds per mask, and the schema's compile
   time. Each library fills a (1, ceil(V / 32)) int32 bitmask, the format all three write.

    TIKTOKEN_CACHE_DIR=... python benchmarks/structured_overhead.py --libraries

Nothing is asserted: timings are noisy (run it alone on the machine; the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from timing import loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script

from gptlab import GPT, GPTConfig
from gptlab.generation import SamplingParams, generate_batch
from gptlab.generation.grammar import RowGrammar
from gptlab.hardware import cpu_name, retain_freed_memory
from gptlab.tokenizer import GPT2Tokenizer

ITEM = {"type": "object", "properties": {"name": {"type": "string"}, "id": {"type": "integer"}},
        "required": ["name", "id"], "additionalProperties": False}
ENDLESS = {"type": "array", "items": ITEM, "minItems": 10_000}  # no end before max_new_tokens
DOCUMENT = json.dumps([{"name": "Alice Smith", "id": 42}, {"name": "Bob", "id": 7}, {"name": "Carol", "id": 1234}],
                      separators=(",", ":"))


def tokens_per_second(model: GPT, tok: GPT2Tokenizer, batch: int, new: int, schema: dict | None, seed: int) -> float:
    prompts = [tok.encode(f"Row {i}: a list of people, as JSON records follow.")[:16] for i in range(batch)]
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=seed, ignore_eot=True, json_schema=schema)
    t0 = time.perf_counter()
    gens = generate_batch(model, prompts, params, tokenizer=tok)
    wall = time.perf_counter() - t0
    assert all(len(g.token_ids) == new for g in gens), "a row ended early: the comparison needs equal tokens"
    return batch * new / wall


NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Olivia",
         "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter")


def records(rng: random.Random, n: int) -> str:
    """A JSON array of n records the ENDLESS schema's items allow, written as the grammar writes them."""
    items = [{"name": rng.choice(NAMES) + (f" {rng.choice(NAMES)}son" if rng.random() < 0.5 else ""),
              "id": rng.randrange(10_000)} for _ in range(n)]
    return json.dumps(items, separators=(",", ":"))


def train_on_records(model: GPT, tok: GPT2Tokenizer, steps: int) -> None:
    """AdamW steps (8 windows of 128 tokens each) on arrays of records: a model that has learnt the format, as one
    asked for JSON would have, whose free draws its grammar mostly allows."""
    rng = random.Random(0)
    stream: list[int] = []
    while len(stream) < 200_000:
        stream += tok.encode(records(rng, 40))
    data, T = torch.tensor(stream), 128
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(len(data) - T - 1, (8,)).tolist()
        x = torch.stack([data[i : i + T] for i in starts])
        y = torch.stack([data[i + 1 : i + T + 1] for i in starts])
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    print(f"trained {steps} steps on JSON records in {time.perf_counter() - t0:.0f} s, last loss {loss.item():.2f}")


def kept_unmasked(model: GPT, tok: GPT2Tokenizer, batch: int, new: int) -> float:
    """The share of constrained draws whose token the grammar allowed as drawn (no mask computed for them), counted
    over one untimed run at this batch."""
    counts = [0, 0]
    allows = RowGrammar.allows

    def counted(self: RowGrammar, token: int) -> bool:
        ok = allows(self, token)
        counts[ok] += 1
        return ok

    RowGrammar.allows = counted
    try:
        tokens_per_second(model, tok, batch, new, ENDLESS, 0)
    finally:
        RowGrammar.allows = allows
    return counts[1] / max(1, sum(counts))


def engine_overhead(args: argparse.Namespace) -> None:
    tok = GPT2Tokenizer()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=args.layers, n_head=args.width // 64,
                    n_embd=args.width)
    model = GPT(cfg).eval()
    print(f"model: {args.layers} layers, width {args.width}, vocabulary {cfg.vocab_size}; {args.new} new tokens; "
          f"{torch.get_num_threads()} threads; {cpu_name()}")
    if args.train_steps:
        train_on_records(model, tok, args.train_steps)
    tokens_per_second(model, tok, 1, 8, ENDLESS, 0)  # warm-up: weights packed, the grammar vocabulary built
    for batch in args.batches:
        free, constrained = [], []
        for r in range(args.rounds):
            free.append(tokens_per_second(model, tok, batch, args.new, None, r))
            constrained.append(tokens_per_second(model, tok, batch, args.new, ENDLESS, r))
        f, c = statistics.median(free), statistics.median(constrained)
        kept = kept_unmasked(model, tok, batch, args.new)
        print(f"batch {batch:>2}: unconstrained {f:8.1f} tok/s, constrained {c:8.1f} tok/s, overhead "
              f"{100 * (1 - c / f):5.1f}%; {100 * kept:.0f}% of constrained draws kept unmasked  (load {loadavg()})")


def _walk(name: str, make, fill, accept, path: list[int]) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    matcher = make()
    compile_ms = 1e3 * (time.perf_counter() - t0)
    times = []
    for rep in range(5):
        matcher = make() if rep else matcher
        for token in path:
            t0 = time.perf_counter()
            fill(matcher)
            times.append(time.perf_counter() - t0)
            if not accept(matcher, token):
                raise RuntimeError(f"{name} refused token {token} of the document")
    print(f"{name:>14}: mask median {1e6 * statistics.median(times):6.1f} us, mean {1e6 * statistics.mean(times):6.1f}"
          f" us; first matcher (schema compiled) {compile_ms:7.1f} ms")


def library_masks() -> None:
    """Each installed library's per-token mask cost along one document's tokens (see the module docstring)."""
    tok = GPT2Tokenizer()
    V, eos = tok.vocab_size, tok.eot_id
    vocab = [tok.decode_bytes([i]) for i in range(V)]
    schema = json.dumps({"type": "array", "items": ITEM})
    path = tok.encode(DOCUMENT)
    bits = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    print(f"document: {len(path)} tokens; vocabulary {V}")
    try:
        import llguidance

        from gptlab.generation.grammar import grammar_vocabulary
        from gptlab.generation.params import json_grammar

        lltok, grammar = grammar_vocabulary(tok), json_grammar(schema)
        _walk("llguidance", lambda: llguidance.LLMatcher(lltok, grammar),
              lambda m: m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4), lambda m, t: m.consume_token(t),
              path)
    except ImportError:
        print("llguidance: not installed")
    try:
        import xgrammar

        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=V, stop_token_ids=[eos])
        compiler, compiled = xgrammar.GrammarCompiler(info), {}

        def make_xgrammar():  # noqa: ANN202 - compiled on the first call (timed), reused after
            if "grammar" not in compiled:
                compiled["grammar"] = compiler.compile_json_schema(schema, any_whitespace=False,
                                                                   separators=(",", ":"))
            return xgrammar.GrammarMatcher(compiled["grammar"])

        _walk("xgrammar", make_xgrammar, lambda m: m.fill_next_token_bitmask(bits, 0),
              lambda m, t: m.accept_token(t), path)
    except ImportError:
        print("xgrammar: not installed")
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i != eos:
                by_bytes.setdefault(b, []).append(i)
        index = {}

        def make_outlines():  # noqa: ANN202 - the index (over the whole vocabulary) built on the first call
            if "index" not in index:
                regex = build_regex_from_schema(schema)
                index["index"] = outlines_core.Index(regex, outlines_core.Vocabulary(eos, by_bytes))
            return outlines_core.Guide(index["index"])

        _walk("outlines-core", make_outlines, lambda m: m.write_mask_into(bits.data_ptr(), bits.numel(), 4),
              lambda m, t: m.advance(t) is not None, path)
    except ImportError:
        print("outlines-core: not installed")


def sampler_cost(rounds: int) -> None:
    """sample_next's cost per step with and without grammars (see the module docstring)."""
    from gptlab.generation.grammar import row_grammar
    from gptlab.generation.params import json_grammar
    from gptlab.generation.sampling import sample_next

    tok, rows = GPT2Tokenizer(), 16
    path = tok.encode(DOCUMENT)
    constraint = ("json_schema", json_grammar(json.dumps({"type": "array", "items": ITEM})))
    params, gens = [SamplingParams(temperature=1.0)] * rows, [None] * rows
    noise = torch.randn(len(path), rows, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    following = noise.clone()
    following[torch.arange(len(path)), :, torch.tensor(path)] = 30.0  # the document's token holds ~all the mass
    cases = {"free rows": (noise, False), "constrained, following the schema": (following, True),
             "constrained, random logits": (noise, True)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (logits, constrained) in cases.items():
            grammars = [row_grammar(constraint, tok, frozenset({tok.eot_id})) for _ in range(rows)] \
                if constrained else [None] * rows
            t0 = time.perf_counter()
            for step, token in enumerate(path):
                sample_next(logits[step], params, gens, grammars=grammars)
                for g in grammars:  # every row walks the document, whatever it drew
                    if g is not None:
                        g.advance(token)
            times[name].append(1e3 * (time.perf_counter() - t0) / len(path))
    free = statistics.median(times["free rows"])
    for name, t in times.items():
        print(f"sample_next, {rows} rows, {name:>34}: {statistics.median(t):6.3f} ms a step "
              f"(+{statistics.median(t) - free:.3f} ms)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--new", type=int, default=64, help="new tokens per row (default 64)")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16], help="batch sizes (none: skip this part)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=0, metavar="N",
                   help="first train the model N steps on JSON records (100: ~75-90 s on 2 cores; default 0: random)")
    p.add_argument("--libraries", action="store_true", help="also time each grammar library's masks")
    p.add_argument("--sampler", action="store_true", help="also time sample_next alone, with and without grammars")
    args = p.parse_args()
    retain_freed_memory()  # as gptlab sample (and, bounded, gptlab serve) do: no page faults for each step's masks
    engine_overhead(args)
    if args.sampler:
        sampler_cost(args.rounds)
    if args.libraries:
        library_masks()


if __name__ == "__main__":
    main()
