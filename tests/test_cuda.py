"""gptlab on an NVIDIA GPU: training against the CPU's fp32 reference, resume, flash attention under bf16,
decoding in CUDA graphs against the plain forward, quantized layers that stay small, and the server. Marked `cuda`
and skipped where no GPU is (`pytest -m cuda` on a GPU machine; `benchmarks/gpu.sh` runs them first)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from families import build as family_model
from helpers import make_data, run_metric, tiny_model, write_recipe

from gptlab.cli import main
from gptlab.generation import Engine, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("cuda_data"))


def _train(recipe: Path, data: Path, out: Path, *extra: str) -> None:
    assert main(["train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", *extra]) == 0


@pytest.fixture(scope="module")
def start(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Path:
    """One CPU step's checkpoint: both devices start from the same weights (the same seed draws other weights on
    a GPU's generator)."""
    root = tmp_path_factory.mktemp("start")
    _train(write_recipe(root, max_steps=1, warmup_steps=0, eval_interval=0), data, root / "run", "--device", "cpu")
    return root / "run"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_on_the_gpu_follows_the_cpu(tmp_path: Path, data: Path, start: Path, dtype: str) -> None:
    """40 steps from the same weights on the same batches: the GPU's losses follow the CPU's (fp32 there runs
    through TF32: rounding to 10 bits; bf16 on both), and they fall."""
    recipe = write_recipe(tmp_path, init_from=str(start), dtype=dtype, eval_interval=0, compile=False)
    _train(recipe, data, tmp_path / "cpu", "--device", "cpu")
    _train(recipe, data, tmp_path / "gpu", "--device", "cuda")
    cpu, gpu = run_metric(tmp_path / "cpu", "train_loss"), run_metric(tmp_path / "gpu", "train_loss")
    assert len(cpu) == len(gpu) >= 8 and gpu[-1] < gpu[0] - 0.3
    tol = 0.02 if dtype == "float32" else 0.08
    assert max(abs(a - b) for a, b in zip(cpu, gpu, strict=True)) < tol, (cpu, gpu)


def test_compiled_bf16_training_with_flash_attention(tmp_path: Path, data: Path, start: Path) -> None:
    """compile "auto" is on for CUDA and attention runs in bf16: under a flash-only SDPA policy the run still
    trains (it would raise if attention were fp32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    recipe = write_recipe(tmp_path, init_from=str(start), dtype="bfloat16", eval_interval=0, max_steps=20)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        _train(recipe, data, tmp_path / "run", "--device", "cuda")
    train = json.loads((tmp_path / "run" / "config.resolved.json").read_text())["train"]
    assert train["compile"] is True and train["attention_fp32"] is False
    losses = run_metric(tmp_path / "run", "train_loss")
    assert losses[-1] < losses[0]


def test_resume_on_the_gpu_continues_the_run(tmp_path: Path, data: Path) -> None:
    """A run stopped at step 20 and resumed (dropout on: the CUDA generator's state comes back) ends where the
    unbroken run ends, within the nondeterminism of CUDA's atomic adds."""
    from safetensors.torch import load_file

    recipe = write_recipe(tmp_path, max_steps=40, checkpoint_interval=20, eval_interval=0, dropout=0.1,
                          keep_last=5, compile=False)
    _train(recipe, data, tmp_path / "ref", "--device", "cuda")
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "ref", broken)
    shutil.rmtree(broken / "checkpoints" / "step-0000040")
    shutil.rmtree(broken / "checkpoints" / "best", ignore_errors=True)
    _train(recipe, data, broken, "--device", "cuda", "--resume")
    ref = load_file(tmp_path / "ref" / "checkpoints" / "step-0000040" / "model.safetensors")
    got = load_file(broken / "checkpoints" / "step-0000040" / "model.safetensors")
    assert all(torch.allclose(got[k], ref[k], rtol=1e-4, atol=1e-5) for k in ref)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_in_cuda_graphs_equals_the_plain_forward(family: str, dtype: torch.dtype) -> None:
    """Rows of different lengths, past a sliding window and the cache's end: the captured step picks the greedy
    tokens the general forward picks (TF32 off for fp32: the comparison is of the same maths)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = (tiny_model(position="learned", vocab_size=97, norm="layernorm", mlp="gelu", n_kv_head=None)
             if family == "gpt2" else family_model(family)).to("cuda", dtype)
    prompts = [[(7 * i + j) % 97 for j in range(n)] for i, n in enumerate((3, 11, 6))]
    new = 30 if family == "gpt2" else 60  # learned positions end at the block

    def greedy(engine: Engine) -> list[list[int]]:
        gens = [engine.prepare(p, SamplingParams(max_new_tokens=new, temperature=0)) for p in prompts]
        engine.add(gens)
        while engine.running:
            engine.step()
        return [g.token_ids for g in gens]

    graphs = Engine(model, 3, static_decode=None)
    assert graphs.kernels()["decode step"] == "CUDA graph"
    plain = Engine(model, 3, static_decode=False)
    got, want = greedy(graphs), greedy(plain)
    if dtype == torch.float32:
        assert got == want
    else:  # bf16: a near-tie may round the other way; the first tokens agree and most of the rest
        assert all(g[:5] == w[:5] for g, w in zip(got, want, strict=True))
    torch.backends.cuda.matmul.allow_tf32 = True


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_on_the_gpu_are_small_and_match_the_reference(mode: str) -> None:
    from gptlab.quantize import QuantizedLinear, quantize_model

    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 4096, bias=True)
    q = QuantizedLinear(layer, mode, group_size=128).to("cuda")
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    ref = q.reference(x).float()
    assert (q(x).float() - ref).norm() / ref.norm() < 1e-2
    model = quantize_model(tiny_model(n_embd=256, n_layer=2).eval(), mode, 32 if mode == "int4" else None)
    model = model.to("cuda", torch.bfloat16)
    weight_bytes = sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantizedLinear)
                       for b in (m.qweight,))
    assert weight_bytes <= sum(m.in_features * m.out_features for m in model.modules()
                               if isinstance(m, QuantizedLinear)) * (1 if mode == "int8" else 0.5)
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (1, 8), device="cuda"))
    assert torch.cuda.memory_allocated() - before < 4 * 2**20  # no lasting wide copy of any weight


def test_quantized_loading_keeps_fp32_weights_off_the_gpu(tmp_path: Path) -> None:
    from gptlab.checkpoint import save_model
    from gptlab.loading import load_model
    from gptlab.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text("abcdefgh ")
    shape = dict(vocab_size=tok.vocab_size, n_embd=512, n_layer=4, n_head=8, n_kv_head=8)
    path = save_model(tmp_path / "ckpt", tiny_model(**shape), tok)
    fp32_bytes = 4 * sum(p.numel() for p in tiny_model(**shape).parameters())
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, _ = load_model(path, device="cuda", dtype=torch.bfloat16, quantize="int8")
    assert torch.cuda.max_memory_allocated() - before < fp32_bytes / 3  # int8 Linears, bf16 embeddings and norms


def test_the_server_answers_from_the_gpu(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from gptlab.checkpoint import save_model
    from gptlab.generation import generate_batch
    from gptlab.loading import load_model
    from gptlab.serve import ServerThread, create_app
    from gptlab.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,\n")
    path = save_model(tmp_path / "ckpt", tiny_model(vocab_size=tok.vocab_size), tok)
    model, tokenizer = load_model(path, device="cuda", dtype=torch.bfloat16)
    (want,) = generate_batch(model, [tokenizer.encode("Hello")], SamplingParams(temperature=0, max_new_tokens=12),
                             tokenizer=tokenizer)
    with ServerThread(create_app(model, tokenizer, model_name="t", max_batch=4)) as server:
        r = httpx.post(server.url + "/v1/completions", json={"model": "t", "prompt": "Hello", "max_tokens": 12,
                                                             "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text


def test_an_odd_lm_head_runs_padded_on_the_gpu() -> None:
    """GPT-2's 50,257-wide head at 50,304 for the tensor cores (ops.upcasting_linear): the same logits and gradients."""
    from gptlab import ops

    torch.manual_seed(0)
    x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    w = torch.randn(50257, 256, device="cuda", requires_grad=True)
    assert ops._gpu_pads(x, w)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, want = ops.upcasting_linear(x, w), torch.nn.functional.linear(x, w)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)  # another kernel may sum in another order
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [x, w], grad), torch.autograd.grad(want, [x, w], grad), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
