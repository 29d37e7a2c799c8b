"""gptlab's hook points, patching and ablation against TransformerLens (its TransformerBridge over the same
`transformers` model, weights unprocessed) on a random GPT-2 and a random grouped-query Llama saved by
save_pretrained. Skipped without transformer-lens."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformer_lens")
from helpers import corpus_text, hf_gpt2_dir, hf_llama_dir  # noqa: E402

from gptlab.hooks import run_with_cache, run_with_hooks  # noqa: E402
from gptlab.inspection.patching import ablation_hooks, activation_patching, logit_difference  # noqa: E402
from gptlab.loading import load_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):  # noqa: ANN001, ANN201
    """(gptlab model, TransformerLens bridge, tokenizer) of one random model, fp32."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM

    make = hf_gpt2_dir if request.param == "gpt2" else hf_llama_dir
    directory = make(tmp_path_factory.mktemp(request.param), corpus_text(20_000))
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf, device="cpu")
    model, tokenizer = load_model(directory, dtype=torch.float32)
    return model.eval(), bridge, tokenizer


def tokens(tokenizer, texts: list[str]) -> torch.Tensor:  # noqa: ANN001
    rows = [tokenizer.encode(t) for t in texts]
    n = min(map(len, rows))
    return torch.tensor([r[:n] for r in rows])


def test_cache_equals_transformer_lens(pair) -> None:  # noqa: ANN001
    model, bridge, tokenizer = pair
    idx = tokens(tokenizer, ["To be, or not to be, that is", "All the world's a stage, and all the"])
    logits, cache = run_with_cache(model, idx)
    ref_logits, ref = bridge.run_with_cache(idx)
    torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=0)
    compared = 0
    for name, value in cache.items():
        if name not in ref or name.endswith("hook_pos_embed"):  # TransformerLens repeats it over the batch
            continue
        expected = ref[name]
        if name.endswith("hook_attn_scores"):  # masked entries: -inf here, the most negative float there
            causal = torch.ones(value.shape[-2:], dtype=torch.bool).tril()
            value, expected = value[..., causal], expected[..., causal]
        torch.testing.assert_close(value, expected, atol=TOL, rtol=0, msg=name)
        compared += 1
    per_layer = ["hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                 "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern", "attn.hook_z",
                 "mlp.hook_pre", "mlp.hook_post"]
    for i in range(model.config.n_layer):
        for point in per_layer:
            assert f"blocks.{i}.{point}" in ref and f"blocks.{i}.{point}" in cache, point
    assert compared >= len(per_layer) * model.config.n_layer


def test_replacing_an_activation_matches_transformer_lens(pair) -> None:  # noqa: ANN001
    model, bridge, tokenizer = pair
    idx = tokens(tokenizer, ["Now is the winter of our discontent"])

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    ours = run_with_hooks(model, idx, {"blocks.0.hook_resid_post": scale, "blocks.1.attn.hook_pattern": scale})
    theirs = bridge.run_with_hooks(idx, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: scale(x)),
                                                   ("blocks.1.attn.hook_pattern", lambda x, hook: scale(x))])
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    assert (ours - run_with_hooks(model, idx, {})).abs().max() > 1e-3  # the hooks changed something


def test_head_ablation_matches_transformer_lens(pair) -> None:  # noqa: ANN001
    model, bridge, tokenizer = pair
    idx = tokens(tokenizer, ["Friends, Romans, countrymen, lend me"])
    reference = tokens(tokenizer, ["Is this a dagger which I see before me", "Once more unto the breach, dear"])
    for kind in ("zero", "mean"):
        fns = ablation_hooks(model, heads=[(1, 0)], neurons=[(0, 3)], kind=kind, reference=reference)
        ours = run_with_hooks(model, idx, fns)
        ref_cache = bridge.run_with_cache(reference)[1]
        z_value = 0 if kind == "zero" else ref_cache["blocks.1.attn.hook_z"][:, :, 0].mean(dim=(0, 1))
        post_value = 0 if kind == "zero" else ref_cache["blocks.0.mlp.hook_post"][..., 3].mean()

        def head(z: torch.Tensor, hook: object, value: object = z_value) -> torch.Tensor:
            z = z.clone()
            z[:, :, 0] = value
            return z

        def neuron(h: torch.Tensor, hook: object, value: object = post_value) -> torch.Tensor:
            h = h.clone()
            h[..., 3] = value
            return h

        theirs = bridge.run_with_hooks(idx, fwd_hooks=[("blocks.1.attn.hook_z", head),
                                                       ("blocks.0.mlp.hook_post", neuron)])
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


def ioi_pair(tokenizer) -> tuple[torch.Tensor, torch.Tensor, int, int]:  # noqa: ANN001
    """"When A and B went to the store, A gave a drink to" (answer B) and the same with B as the giver
    (answer A), from two names whose tokens are equally many: both prompts are the same length."""
    names = [" John", " Mary", " Tom", " Anne", " Will", " Kate", " Hal", " Bess"]
    start = tokenizer.encode("")  # a Llama tokenizer's <s>
    pieces = {n: tokenizer.encode(n)[len(start):] for n in names}
    a, b = next((x, y) for x in names for y in names if x != y and len(pieces[x]) == len(pieces[y]))

    def prompt(giver: str) -> list[int]:
        words = ["When", a, " and", b, " went to the store,", giver, " gave a drink to"]
        return start + [t for w in words for t in tokenizer.encode(w)[len(start):]]

    return torch.tensor([prompt(a)]), torch.tensor([prompt(b)]), pieces[b][0], pieces[a][0]


def test_ioi_patching_matches_transformer_lens(pair) -> None:  # noqa: ANN001
    """Patching the clean residual stream into the corrupted run, per layer and position, and each head's
    output over all positions, on an indirect-object-identification-style pair, as TransformerLens' patching."""
    from transformer_lens import patching

    model, bridge, tokenizer = pair
    clean, corrupt, answer, wrong = ioi_pair(tokenizer)
    metric = logit_difference(answer, wrong)
    _, clean_cache = bridge.run_with_cache(clean)

    def tl_metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, answer] - logits[0, -1, wrong]

    ours = activation_patching(model, clean, corrupt, metric, point="hook_resid_pre")
    theirs = patching.get_act_patch_resid_pre(bridge, corrupt, clean_cache, tl_metric)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    assert ours.shape == (model.config.n_layer, clean.shape[1])
    ours = activation_patching(model, clean, corrupt, metric, point="attn.hook_z", positions=False)
    theirs = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, clean_cache, tl_metric)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    assert ours.shape == (model.config.n_layer, model.config.n_head)
