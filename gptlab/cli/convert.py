"""`gptlab convert SRC DST`: a Hugging Face directory -> a gptlab checkpoint, or a gptlab checkpoint / run
-> a Hugging Face directory. The direction follows from SRC unless --to says otherwise."""

from __future__ import annotations

import argparse

from gptlab.cli.options import torch_dtype
from gptlab.errors import GptlabError

# the families gptlab.interop.registry lists (named here: importing it imports torch, and --help should not)
HF_ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "GPTNeoXForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
                    "GPTJForCausalLM")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert between gptlab checkpoints and Hugging Face directories",
        description=f"A Hugging Face directory ({', '.join(HF_ARCHITECTURES)}) becomes a gptlab checkpoint; "
        "a gptlab checkpoint or run becomes a Hugging Face directory; either becomes one GGUF file for "
        "llama.cpp with --to gguf (every family llama.cpp runs), or a directory for ollama with --to ollama. The "
        "tokenizer comes along when SRC has one. DST is replaced atomically. A LoRA run is written with its "
        "adapters merged into the base, or with --adapter-only as a peft adapter directory.",
    )
    p.add_argument("src", metavar="SRC", help="a Hugging Face model directory, a gptlab checkpoint or a run")
    p.add_argument("dst", metavar="DST", help="the directory to write")
    p.add_argument("--to", choices=["hf", "gptlab", "gguf", "ollama"],
                   help="output format (default: the one SRC is not in); gguf: one file llama.cpp runs; ollama: a "
                   "directory with that file and a Modelfile (then: ollama create NAME -f DST/Modelfile)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "f32", "f16", "bf16", "q8_0", "q4_0"],
                   help="cast the weights (default: keep theirs; for --to gguf: f16); q8_0, q4_0: GGUF's 8, 4 bits")
    p.add_argument("--adapter-only", action="store_true",
                   help="a LoRA run: write only its adapters, as a peft directory (PeftModel.from_pretrained)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.conversion import convert

    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
    long = {v: k for k, v in short.items()}
    if args.to in ("gguf", "ollama"):
        done = convert(args.src, args.dst, to=args.to, adapter_only=args.adapter_only,
                       gguf_dtype=short.get(args.dtype, args.dtype or "f16"))
        file = done.destination if args.to == "gguf" else done.destination / "model.gguf"
        print(f"wrote GGUF ({done.model.num_parameters():,} parameters, {args.dtype or 'f16'}, "
              f"{file.stat().st_size / 2**20:.1f} MiB) to {file}")
        if args.to == "ollama":
            print(f"wrote {done.destination / 'Modelfile'}: ollama create NAME -f {done.destination / 'Modelfile'}")
            if done.no_tokenizer_reason:
                print(f"note: {done.no_tokenizer_reason}")
        return 0
    if args.dtype in ("q8_0", "q4_0"):
        raise GptlabError(f"--dtype {args.dtype} is a GGUF format: add --to gguf")
    dtype = long.get(args.dtype, args.dtype)
    done = convert(args.src, args.dst, to=args.to, dtype=torch_dtype(dtype, "cpu") if dtype else None,
                   adapter_only=args.adapter_only)
    model, dst = done.model, done.destination
    if done.to == "peft":
        print(f"wrote a peft LoRA adapter for {done.base} to {dst}: {', '.join(sorted(p.name for p in dst.iterdir()))}")
        if done.no_tokenizer_reason:
            print(f"note: {done.no_tokenizer_reason}")
        return 0
    n, dtype_name = model.num_parameters(), str(model.lm_head.weight.dtype).removeprefix("torch.")
    what = f"Hugging Face {done.architecture}" if done.to == "hf" else done.architecture
    print(f"wrote {what} ({n:,} parameters, {dtype_name}) to {dst}: "
          f"{', '.join(sorted(p.name for p in dst.iterdir()))}")
    if done.tokenizer is None:
        print(f"note: no tokenizer copied ({done.no_tokenizer_reason})")
    elif done.to == "hf" and not (dst / "tokenizer.json").is_file():
        print(f"note: the {done.tokenizer.kind} tokenizer was saved in gptlab's format only (no tokenizer.json), "
              "so transformers cannot load it")
    return 0
