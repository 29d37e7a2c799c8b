"""Generation throughput: gptlab's engine against transformers' generate(), same weights, same process.

GPT-2 124M shape with random weights (`GPTConfig.preset("gpt2")`), a 16-token prompt, 256 new tokens, greedy,
2 threads, at batch 1 and 32. The transformers model is the gptlab one written with `gptlab.interop.save_hf`
and read back with `GPT2LMHeadModel.from_pretrained`, so both hold identical weights; the greedy tokens of the
two are compared in fp32 first. Tokens/s = batch x new tokens / wall time of the whole call (prefill included),
the best of --repeats alternating rounds. Prints results only: timings on shared machines are noisy, so nothing
is asserted.

    python benchmarks/generate_throughput.py                       # the default comparison
    python benchmarks/generate_throughput.py --settings 1:bfloat16 --skip-hf
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from gptlab import GPT, GPTConfig, generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def timed(fn) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def hf_model(model: GPT):  # noqa: ANN201
    from transformers import GPT2LMHeadModel

    from gptlab.interop import save_hf

    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, tmp)
        hf = GPT2LMHeadModel.from_pretrained(tmp, dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = hf.config.eos_token_id
    return hf


def ours_generate(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    return generate(model, idx, n, temperature=0)


@torch.inference_mode()
def hf_generate(hf, idx: torch.Tensor, n: int) -> torch.Tensor:  # noqa: ANN001
    # min_new_tokens: random weights may emit end-of-text, which must not end the run early
    return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="1:float32,1:bfloat16,32:bfloat16",
                    help="batch:dtype pairs to time (add 32:float32 for the fp32 batch; slow where fp32 GEMMs "
                         "are, e.g. MKL on AMD CPUs)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed rounds per setting, contenders alternating; each one's best round counts")
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared with transformers")
    ap.add_argument("--skip-hf", action="store_true", help="time gptlab only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2")).eval()
    hf = None if args.skip_hf else hf_model(model)
    V = model.config.vocab_size
    print(f"GPT-2 124M shape, random weights; prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")

    if hf is not None and args.check_tokens:
        idx = torch.randint(0, V, (2, args.prompt_len))
        ours = ours_generate(model, idx, args.check_tokens)
        theirs = hf_generate(hf, idx, args.check_tokens)
        same = int((ours == theirs).all(dim=0).sum()) - args.prompt_len
        print(f"greedy tokens agree with transformers (fp32, batch 2): {same == args.check_tokens} "
              f"({same}/{args.check_tokens} positions)")

    rows = []
    for setting in args.settings.split(","):
        B, name = int(setting.split(":")[0]), setting.split(":")[1]
        idx = torch.randint(0, V, (B, args.prompt_len))
        result: dict[str, float] = {}
        contenders = [("gptlab", model, ours_generate)] + ([("transformers", hf, hf_generate)] if hf else [])
        for _, m, gen in contenders:
            m.to(DTYPES[name])  # fp32 -> bf16 -> fp32 rounds the weights: harmless for timing
            gen(m, idx, 4)  # warm-up: first-call allocations and kernel selection
        for _ in range(args.repeats):  # alternate the contenders, so a busy spell on the machine hits both
            for who, m, gen in contenders:
                seconds = timed(lambda m=m, gen=gen, idx=idx: gen(m, idx, args.new_tokens))
                result[who] = max(result.get(who, 0.0), B * args.new_tokens / seconds)
                print(f"  batch {B:>3} {name:>8} {who:>12}: {B * args.new_tokens / seconds:8.1f} tokens/s",
                      flush=True)
        for _, m, _ in contenders:
            m.to(torch.float32)
        rows.append((B, name, result))

    print("\n| batch | dtype | gptlab tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|---|")
    for B, name, r in rows:
        theirs = r.get("transformers")
        ratio = f"{r['gptlab'] / theirs:.1f}x" if theirs else "-"
        print(f"| {B} | {name} | {r['gptlab']:.1f} | {f'{theirs:.1f}' if theirs else '-'} | {ratio} |")


if __name__ == "__main__":
    main()
