"""Generation throughput: gptlab's engine against peers (transformers, llama.cpp, CTranslate2), same weights.

GPT-2 124M shape with random weights (`GPTConfig.preset("gpt2")`), a 16-token prompt, 256 new tokens, greedy, 2
threads, at batch 1 and 32. Every peer gets gptlab's own weights: transformers and CTranslate2 through
`gptlab.interop.save_hf` (CTranslate2's converter reads that directory), llama.cpp through gptlab's GGUF export
(`save_gguf`, in the setting's dtype: bf16 or f32; for the int8 / int4 settings llama.cpp's q8_0 / q4_0 beside
gptlab's `--quantize int8` / `int4` (group 32), and CTranslate2's int8). llama.cpp decodes a batch the way its
`batched` example does: one `llama_batch` holding a token of each of the B sequences per step (llama-cpp-python's
low-level bindings), greedy by an argmax over the returned logits. Tokens/s = batch x new tokens / wall time of the
whole call (prefill included). Each contender runs in a process of its own (same seed, same random weights), so no
engine's idle threads (llama.cpp's spin-waiting pool) compete with another's timing: in one process, llama.cpp's
pool slowed gptlab's batch-1 bf16 decoding from 63 to 37 tokens/s. Contenders alternate over --rounds, so a busy
spell on a shared machine hits all of them; the median round counts, and the ratio gptlab / peer is printed. Nothing
is asserted: timings are noisy.

Peers are optional (the `bench` extra): a missing one is skipped with a message. On a shared machine run it in
its own session with raised priority (see the README):

    OMP_NUM_THREADS=2 setsid sh -c 'echo -20 > /proc/self/autogroup; exec python benchmarks/generate_throughput.py \
        --peers llamacpp --settings 1:bfloat16,32:bfloat16,1:float32,1:int8,1:int4 --rounds 3'

GPT-2's tokenizer is needed for the GGUF file (TIKTOKEN_CACHE_DIR for an offline machine).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from timing import loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script

from gptlab import GPT, GPTConfig, generate, quantize_model
from gptlab.generation.api import PACK_MIN_TOKENS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


QUANTIZED = ("int8", "int4")  # weight-only, gptlab's `--quantize` (int4 in groups of 32); other weights fp32


class Gptlab:
    name = "gptlab"

    def __init__(self, model: GPT) -> None:
        self.source, self.model = model, model

    def setting(self, dtype: str, batch: int) -> None:
        if dtype in QUANTIZED:  # a quantized copy of the fp32 model (the source stays as it is)
            self.model = quantize_model(copy.deepcopy(self.source.float()), dtype)
        else:
            self.model = self.source.to(DTYPES[dtype])  # fp32 -> bf16 -> fp32 rounds the weights: harmless here

    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        return generate(self.model, idx, n, temperature=0)


class Transformers:
    name = "transformers"

    def __init__(self, model: GPT, hf_dir: Path, threads: int) -> None:
        from transformers import GPT2LMHeadModel

        self.hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.hf.generation_config.pad_token_id = self.hf.config.eos_token_id

    def setting(self, dtype: str, batch: int) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"{dtype} is not timed for transformers (its CPU quantization is another library's)")
        self.hf.to(DTYPES[dtype])

    @torch.inference_mode()
    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        # min_new_tokens: random weights may emit end-of-text, which must not end the run early
        return self.hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)


class LlamaCpp:
    """llama.cpp on gptlab's GGUF export, batched as its `batched` example does (see the module docstring)."""

    name = "llama.cpp"
    GGUF = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # its 8- and 4-bit formats

    def __init__(self, model: GPT, tmp: Path, threads: int, n_ctx_per_row: int) -> None:
        import llama_cpp

        from gptlab.interop.gguf import save_gguf
        from gptlab.tokenizer import GPT2Tokenizer

        self.ll, self.src, self.tmp, self.threads = llama_cpp, model, tmp, threads
        self.n_ctx_per_row, self.tokenizer = n_ctx_per_row, GPT2Tokenizer()
        self.save_gguf = save_gguf
        self.model = self.ctx = self.batch = None
        self.V = model.config.vocab_size
        llama_cpp.llama_backend_init()
        self._quiet = llama_cpp.llama_log_callback(lambda *a: None)  # kept: C holds only a pointer to it
        llama_cpp.llama_log_set(self._quiet, ctypes.c_void_p(0))

    def close(self) -> None:
        ll = self.ll
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
        if self.ctx is not None:
            ll.llama_free(self.ctx)
        if self.model is not None:
            ll.llama_model_free(self.model)
        self.model = self.ctx = self.batch = None

    def setting(self, dtype: str, batch: int) -> None:
        ll = self.ll
        self.close()
        path = self.tmp / f"model-{self.GGUF[dtype]}.gguf"
        if not path.exists():
            self.save_gguf(self.src.float(), path, self.tokenizer, dtype=self.GGUF[dtype])
        mparams = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = batch * self.n_ctx_per_row
        cparams.n_seq_max = batch
        cparams.n_batch = cparams.n_ubatch = max(batch * 64, 512)
        cparams.n_threads = cparams.n_threads_batch = self.threads
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = ll.llama_batch_init(cparams.n_batch, 0, batch)

    def _decode(self, rows: list[list[int]], start: int) -> np.ndarray:
        """Append each row's tokens to its sequence (positions start..); the logits at each row's last token."""
        b, i = self.batch, 0
        for seq, tokens in enumerate(rows):
            for j, tok in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, start + j, 1
                b.seq_id[i][0], b.logits[i] = seq, j == len(tokens) - 1
                i += 1
        b.n_tokens = i
        if self.ll.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = self.ll.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(out, shape=(len(rows), self.V))

    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        rows = idx.tolist()
        T = len(rows[0])
        new = self._decode(rows, 0).argmax(axis=1)
        out = [new]
        for step in range(1, n):
            new = self._decode([[int(t)] for t in new], T + step - 1).argmax(axis=1)
            out.append(new)
        return torch.cat([idx, torch.from_numpy(np.stack(out, axis=1))], dim=1)


class CTranslate2:
    """CTranslate2's Generator on its conversion of gptlab's Hugging Face export."""

    name = "ct2"
    COMPUTE = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8_float32"}  # no 4-bit on CPU

    def __init__(self, model: GPT, hf_dir: Path, threads: int, tmp: Path) -> None:
        import ctranslate2

        from gptlab.interop.gguf import gguf_vocabulary
        from gptlab.tokenizer import GPT2Tokenizer

        # gptlab's GPT-2 export names tiktoken's files; CTranslate2's converter wants GPT-2's vocab.json + merges
        tokens, merges, _ = gguf_vocabulary(GPT2Tokenizer(), model.config.vocab_size)
        (hf_dir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
        (hf_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        (hf_dir / "tokenizer_meta.json").unlink(missing_ok=True)
        out = tmp / "ct2"
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out), force=True)
        self.ct2, self.dir, self.threads, self.generator = ctranslate2, out, threads, None
        self.tokens = json.loads((out / "vocabulary.json").read_text(encoding="utf-8"))

    def setting(self, dtype: str, batch: int) -> None:
        if dtype not in self.COMPUTE:
            raise ValueError(f"CTranslate2 has no {dtype} compute type on CPU")
        self.generator = self.ct2.Generator(str(self.dir), device="cpu", compute_type=self.COMPUTE[dtype],
                                            intra_threads=self.threads)

    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        prompts = [[self.tokens[t] for t in row] for row in idx.tolist()]
        results = self.generator.generate_batch(prompts, max_length=n, min_length=n, sampling_topk=1,
                                                include_prompt_in_result=False)
        return torch.cat([idx, torch.tensor([r.sequences_ids[0][:n] for r in results])], dim=1)


def make_contender(name: str, model: GPT, args: argparse.Namespace, tmp: Path) -> object:
    """gptlab or one peer, holding `model`'s weights (ImportError where the peer is not installed)."""
    if name == "gptlab":
        return Gptlab(model)
    if name == "llamacpp":
        return LlamaCpp(model, tmp, args.threads, args.prompt_len + args.new_tokens + 16)
    if name not in ("transformers", "ct2"):
        raise ValueError(name)
    from gptlab.interop import save_hf
    from gptlab.tokenizer import GPT2Tokenizer

    hf_dir = tmp / "hf"
    save_hf(model, hf_dir, GPT2Tokenizer())
    if name == "transformers":
        return Transformers(model, hf_dir, args.threads)
    return CTranslate2(model, hf_dir, args.threads, tmp)


def worker(conn, name: str, args: argparse.Namespace) -> None:  # noqa: ANN001
    """One contender in a process of its own, so that no engine's threads (llama.cpp's spin-waiting pool,
    torch's OpenMP team) run beside another's timing: it builds the same random model (same seed), then answers
    ("setting", dtype, batch) and ("generate", idx, n) -> (seconds, tokens) until ("close",)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2")).eval()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            contender = make_contender(name, model, args, Path(tmp))
        except ImportError as e:
            conn.send(("missing", f"{e.name or e} is not installed (pip install 'gptlab[bench]')"))
            return
        conn.send(("ready", getattr(contender, "name", name)))
        while (msg := conn.recv())[0] != "close":
            if msg[0] == "setting":
                try:
                    contender.setting(*msg[1:])
                    conn.send(None)
                except (ValueError, RuntimeError) as e:  # e.g. CTranslate2 without bf16 on this CPU, or int4
                    conn.send(str(e).splitlines()[0])
            else:
                t = time.perf_counter()
                out = contender.generate(*msg[1:])
                conn.send((time.perf_counter() - t, out))
        getattr(contender, "close", lambda: None)()


class Remote:
    """The parent's handle on a worker process."""

    def __init__(self, ctx, name: str, args: argparse.Namespace) -> None:  # noqa: ANN001
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker, args=(child, name, args), daemon=True)
        self.process.start()
        status, self.name = self.conn.recv()
        self.missing = self.name if status == "missing" else None

    def setting(self, dtype: str, batch: int) -> str | None:
        """None, or why this contender cannot run the setting."""
        self.conn.send(("setting", dtype, batch))
        return self.conn.recv()

    def generate(self, idx: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
        self.conn.send(("generate", idx, n))
        return self.conn.recv()

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("close",))
        self.process.join()


def check_tokens(contenders: list[Remote], V: int, args: argparse.Namespace) -> None:
    """How many greedy tokens (fp32, batch 2) each peer shares with gptlab before the first difference."""
    idx = torch.randint(0, V, (2, args.prompt_len))
    for c in contenders:
        c.setting("float32", 2)
    ours = contenders[0].generate(idx, args.check_tokens)[1][:, args.prompt_len :]
    for c in contenders[1:]:
        theirs = c.generate(idx, args.check_tokens)[1][:, args.prompt_len :]
        same = (ours == theirs).all(dim=0).int().cumprod(0).sum()
        print(f"greedy tokens (fp32, batch 2): {c.name} agrees with gptlab on the first {int(same)}/"
              f"{args.check_tokens}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="1:float32,1:bfloat16,32:bfloat16",
                    help="batch:dtype pairs to time (dtype float32, bfloat16, int8 or int4)")
    ap.add_argument("--peers", default="transformers",
                    help="comma-separated peers: transformers, llamacpp, ct2 ('' for gptlab alone)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per setting, contenders alternating")
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared with each peer (0: none)")
    args = ap.parse_args()
    names = [p for p in args.peers.split(",") if p]
    for p in names:
        if p not in ("transformers", "llamacpp", "ct2"):
            raise SystemExit(f"error: --peers: unknown peer {p!r} (transformers, llamacpp, ct2)")
    torch.manual_seed(1)
    V = GPTConfig.preset("gpt2").vocab_size
    print(f"GPT-2 124M shape, random weights; prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, "
          f"{args.threads} threads, torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}; "
          "each contender in its own process")
    ctx = multiprocessing.get_context("spawn")
    contenders = []
    for name in ["gptlab", *names]:
        remote = Remote(ctx, name, args)
        if remote.missing:
            print(f"skipping peer {name}: {remote.missing}")
            remote.close()
        else:
            contenders.append(remote)
    peers = [c.name for c in contenders[1:]]
    if peers and args.check_tokens:
        check_tokens(contenders, V, args)
    rows = []
    for setting in args.settings.split(","):
        B, dtype = int(setting.split(":")[0]), setting.split(":")[1]
        idx = torch.randint(0, V, (B, args.prompt_len))
        running = []
        for c in contenders:
            problem = c.setting(dtype, B)
            if problem:
                print(f"  skipping {c.name} at batch {B} {dtype}: {problem}")
                continue
            running.append(c)
            # warm-up: first-call allocations, kernel selection, and weight packing (generate packs them once
            # per model from PACK_MIN_TOKENS new tokens on, as llama.cpp lays its weights out once at load)
            c.generate(idx, PACK_MIN_TOKENS)
        result: dict[str, list[float]] = {c.name: [] for c in running}
        for r in range(args.rounds):
            load = loadavg()
            for c in running:
                rate = B * args.new_tokens / c.generate(idx, args.new_tokens)[0]
                result[c.name].append(rate)
                print(f"  round {r + 1} (load {load}) batch {B:>3} {dtype:>8} {c.name:>12}: "
                      f"{rate:8.1f} tokens/s", flush=True)
        rows.append((B, dtype, {k: statistics.median(v) for k, v in result.items()}))
    for c in contenders:
        c.close()
    print(f"\nmedians of {args.rounds} rounds, tokens/s (ratio gptlab / peer)")
    print("| batch | dtype | gptlab | " + " | ".join(peers) + " |")
    print("|---|---|---|" + "---|" * len(peers))
    for B, dtype, r in rows:
        cells = [f"{r[n]:.1f} ({r['gptlab'] / r[n]:.2f}x)" if n in r else "-" for n in peers]
        print(f"| {B} | {dtype} | {r['gptlab']:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
