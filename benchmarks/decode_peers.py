"""The peers of benchmarks/generate_throughput.py, each holding gptlab's own weights: transformers (its Hugging Face
export), llama.cpp through llama-cpp-python's low-level bindings and through its own `llama-bench` /
`llama-batched-bench` programs (gptlab's GGUF export), CTranslate2 (its conversion of the Hugging Face export)."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import torch
from timing import run_timed  # benchmarks/ is on sys.path when a benchmark runs as a script

from gptlab import GPT

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GGUF = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # llama.cpp's 8- and 4-bit formats


def gguf_file(model: GPT, tmp: Path, dtype: str) -> Path:
    """gptlab's GGUF export of `model` in llama.cpp's format for `dtype` (written once per directory)."""
    from gptlab.interop.gguf import save_gguf
    from gptlab.tokenizer import GPT2Tokenizer

    path = tmp / f"model-{GGUF[dtype]}.gguf"
    if not path.exists():
        save_gguf(model.float(), path, GPT2Tokenizer(), dtype=GGUF[dtype])
    return path


class Transformers:
    name = "transformers"

    def __init__(self, model: GPT, hf_dir: Path, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
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

    def __init__(self, model: GPT, tmp: Path, threads: int, n_ctx_per_row: int) -> None:
        import llama_cpp

        self.ll, self.src, self.tmp, self.threads = llama_cpp, model, tmp, threads
        self.n_ctx_per_row = n_ctx_per_row
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
        path = gguf_file(self.src, self.tmp, dtype)
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


class LlamaBench:
    """llama.cpp's own C++ benchmarks on gptlab's GGUF export: `llama-bench` (batch 1: its tg test, -n new tokens
    after no prompt) and `llama-batched-bench` (batch B: B sequences of the prompt length, then new tokens), each
    run as a process of its own at raised priority; tokens/s as the program reports it (generation only)."""

    name = "llama-bench"

    def __init__(self, model: GPT, tmp: Path, threads: int, build: Path) -> None:
        self.src, self.tmp, self.threads, self.dtype, self.batch = model, tmp, threads, "float32", 1
        self.bench, self.batched = build / "bin" / "llama-bench", build / "bin" / "llama-batched-bench"
        if not self.bench.exists():
            raise FileNotFoundError(f"{self.bench} does not exist: build llama.cpp's llama-bench there")

    def setting(self, dtype: str, batch: int) -> None:
        if dtype not in GGUF:
            raise ValueError(f"llama.cpp has no {dtype}")
        self.dtype, self.batch, self.path = dtype, batch, gguf_file(self.src, self.tmp, dtype)

    def rate(self, prompt_len: int, n: int) -> float:
        t = str(self.threads)
        if self.batch == 1:
            _, r = run_timed([str(self.bench), "-m", str(self.path), "-p", "0", "-n", str(n), "-t", t, "-r", "1",
                              "-o", "json"])
            return float(json.loads(r.stdout)[0]["avg_ts"])
        ctx = self.batch * (prompt_len + n + 16)
        _, r = run_timed([str(self.batched), "-m", str(self.path), "-c", str(ctx), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt_len), "-ntg", str(n), "-npl", str(self.batch), "-t", t, "-tb", t,
                          "--output-format", "jsonl"])
        lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("{")]
        return float(json.loads(lines[-1])["speed_tg"])
