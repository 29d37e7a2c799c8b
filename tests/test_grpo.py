"""GRPO: the clipped loss with its KL term equal to trl's GRPOTrainer (loss and gradients, fp32, within 1e-5) on the
same rollouts, advantages against their formula, rewards (built in, named in a recipe, refused with one line), the
prompts taken from prepared records, and `train --objective grpo` end to end: rewards in metrics.jsonl, exact resume
after SIGKILL (tests/test_faults.py), LoRA with the base as its reference, `gptlab chat` on the result."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_llama_dir, one_line_error, write_jsonl

from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.tokenizer import CharTokenizer
from gptlab.tokenizer.chat_template import chat_template_for
from gptlab.train.grpo import (
    completion_losses,
    completion_rows,
    cut_at,
    group_advantages,
    prompts_and_replies,
    reply_ends,
    token_logps,
)
from gptlab.train.recipe import build_train_config
from gptlab.train.rewards import arithmetic_records, exact_match, load_reward, reward_value


# --- the loss against trl ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    text = "the quick brown fox jumps over the lazy dog " * 200
    return hf_llama_dir(tmp_path_factory.mktemp("grpo_llama") / "m", text, vocab_size=300)


def rollouts(vocab: int, prompts: int = 2, group: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of one length (trl left-pads prompts), each repeated `group` times, and completions of several."""
    g = np.random.default_rng(0)
    ps = [g.integers(3, vocab, 5).tolist() for _ in range(prompts)]
    return ([p for p in ps for _ in range(group)],
            [g.integers(3, vocab, int(g.integers(2, 7))).tolist() for _ in range(prompts * group)])


def trl_loss_and_grads(model_dir: Path, prompts: list, completions: list, advantages: torch.Tensor,
                       old: torch.Tensor, ref: torch.Tensor, beta: float, out: Path, temperature: float = 1.0
                       ) -> tuple[float, dict[str, torch.Tensor]]:
    """trl's GRPOTrainer._compute_loss (loss_type "grpo") on the rollouts, old and reference per-token logps given."""
    trl = pytest.importorskip("trl")
    import transformers
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    args = trl.GRPOConfig(output_dir=str(out), beta=beta, epsilon=0.2, loss_type="grpo", report_to=[], use_cpu=True,
                          per_device_train_batch_size=len(prompts), num_generations=3, bf16=False, fp16=False,
                          temperature=temperature)
    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, processing_class=tok, train_dataset=Dataset.from_list([{"prompt": "a"}] * 6))
    width = max(map(len, completions))
    completion_ids = torch.tensor([c + [0] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    inputs = {"prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones(len(prompts), len(prompts[0]), dtype=int),
              "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": advantages,
              "old_per_token_logps": old, "ref_per_token_logps": ref}
    trainer.model.float().train()
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before a step
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.04, 1.0), (0.04, 0.7)])
def test_grpo_loss_and_gradients_equal_trls(llama: Path, tmp_path: Path, beta: float, temperature: float) -> None:
    """At a temperature other than 1 both score the completions under softmax(logits / T), what they sampled."""
    from gptlab import from_hf

    model = from_hf(llama).float().train()
    prompts, completions = rollouts(model.config.vocab_size)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0]), 3)
    width = max(map(len, completions))
    g = torch.Generator().manual_seed(3)
    # old and reference log-probabilities apart from the policy's: ratios on both sides of the clip, a KL to count
    x, y = completion_rows(prompts, completions)
    logps = token_logps(model, x, y, temperature)
    mask = y != -1
    old_dense = (logps.detach() + 0.3 * torch.randn(logps.shape, generator=g)) * mask
    ref_dense = (logps.detach() + 0.2 * torch.randn(logps.shape, generator=g)) * mask
    old, ref = torch.zeros(len(prompts), width), torch.zeros(len(prompts), width)  # trl's (N, completion) layout
    for i, c in enumerate(completions):
        old[i, : len(c)], ref[i, : len(c)] = old_dense[i][mask[i]], ref_dense[i][mask[i]]
    want_loss, want = trl_loss_and_grads(llama, prompts, completions, advantages, old, ref, beta, tmp_path,
                                         temperature)

    losses, kl = completion_losses(logps, old_dense, ref_dense if beta else None, advantages, mask, 0.2, beta)
    loss = losses.mean()
    loss.backward()
    ratio = torch.exp(logps - old_dense)[mask]
    assert (ratio > 1.2).any() and (ratio < 0.8).any()  # the clip is exercised both ways
    assert abs(float(loss) - want_loss) < 1e-5 and float(loss) != 0.0
    assert (float(kl.sum()) > 0) == bool(beta)
    n = model.config.n_layer
    same = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight",
            **{f"transformer.h.{i}.attn.c_proj.weight": f"model.layers.{i}.self_attn.o_proj.weight" for i in range(n)},
            **{f"transformer.h.{i}.mlp.c_proj.weight": f"model.layers.{i}.mlp.down_proj.weight" for i in range(n)}}
    params = dict(model.named_parameters())
    compared = [ours for ours in same if ours in params]
    assert len(compared) >= 2 * n + 2
    for ours in compared:
        torch.testing.assert_close(params[ours].grad, want[same[ours]], atol=1e-5, rtol=1e-4)


def test_advantages_are_relative_to_the_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    got = group_advantages(rewards, 4)
    for start in (0, 4):
        r = rewards[start : start + 4].tolist()
        mean = sum(r) / 4
        std = math.sqrt(sum((v - mean) ** 2 for v in r) / 3)  # unbiased, as trl's nanstd
        assert got[start : start + 4].tolist() == pytest.approx([(v - mean) / (std + 1e-4) for v in r], abs=1e-6)
    assert got[4:].abs().max() == 0  # a group of equal rewards teaches nothing


def test_a_ratio_of_one_gives_the_policy_gradient() -> None:
    """With the old policy the current one (trl's num_iterations 1) the loss is -A per token, its gradient -A grad
    log p averaged over each completion's tokens."""
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    losses, _ = completion_losses(logps, logps.detach(), None, torch.tensor([2.0, -1.0]), mask, 0.2, 0.0)
    losses.sum().backward()
    assert losses.tolist() == pytest.approx([-2.0, 1.0])
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]]))


# --- rewards and prompts ----------------------------------------------------------------------------------------
def test_exact_match_and_the_arithmetic_task() -> None:
    records = list(arithmetic_records(50, seed=3))
    assert records == list(arithmetic_records(50, seed=3)) and records != list(arithmetic_records(50, seed=4))
    for r in records:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["completion"]) == int(a) + int(b)
    assert exact_match("1+2=", " 3 \nextra", "3") == 1.0
    assert exact_match("1+2=", "30", "3") == 0.0 and exact_match("1+2=", "", "3") == 0.0
    assert load_reward("gptlab.train.rewards:exact_match") is exact_match


@pytest.mark.parametrize(("spec", "expected"), [
    ("exact_match", "expected \"module:function\""),
    ("no_such_module_here:f", "cannot import no_such_module_here"),
    ("gptlab.train.rewards:nothing", "has no function nothing"),
])
def test_a_bad_reward_name_is_one_line_before_anything_runs(spec: str, expected: str) -> None:
    from gptlab.errors import GptlabError

    with pytest.raises(GptlabError, match=expected):
        build_train_config({"objective": "grpo", "reward": spec})


def test_prompts_and_replies_come_from_the_masked_windows() -> None:
    tok = CharTokenizer(set("0123456789+=UserAssistant: \n"))
    template = chat_template_for(tok, "plain")
    assert reply_ends(template) == ("\n", "\nUser:")
    assert cut_at("12\nUser: 3", reply_ends(template)) == "12"
    x = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 0, 0]])
    y = torch.tensor([[-1, -1, 8, 9, -1, -1], [-1, 7, 8, -1, -1, -1]])
    assert prompts_and_replies(x, y) == [([5, 6, 7], [8, 9]), ([5, 6], [7, 8])]
    cx, cy = completion_rows([[5, 6], [5]], [[1, 2], [3]])
    assert cx.tolist() == [[5, 6, 1], [5, 3, 0]] and cy.tolist() == [[-1, 1, 2], [3, -1, -1]]


# --- a run ------------------------------------------------------------------------------------------------------
def arithmetic_data(root: Path, packed: bool = False) -> Path:
    records = write_jsonl(root / "sums.jsonl", list(arithmetic_records(600, seed=0, digits=1)))
    out = root / ("packed" if packed else "data")
    assert main(["prepare", str(records), "--tokenizer", "char", "--block-size", "24", "--out", str(out),
                 *([] if packed else ["--no-pack"])]) == 0
    return out


GRPO_RECIPE = ('objective = "grpo"\nbatch_size = 4\ngroup_size = 4\nmax_new_tokens = 4\nmax_steps = 6\n'
               "warmup_steps = 1\nlog_interval = 1\nlr = 3e-3\ntensorboard = false\nthreads = 1\n")


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data of one-digit sums, a tiny model trained on them a little)."""
    root = tmp_path_factory.mktemp("grpo_sft")
    data = arithmetic_data(root)
    recipe = root / "sft.toml"
    recipe.write_text('model = "tiny"\nbatch_size = 16\nmax_steps = 40\nwarmup_steps = 2\nlr = 1e-2\n'
                      "block_size = 32\ntensorboard = false\nthreads = 1\ndropout = 0.0\n")
    assert main(["train", str(recipe), "--data", str(data), "--out", str(root / "sft"), "--quiet"]) == 0
    return data, root / "sft"


def test_train_grpo_logs_rewards_and_chats(sft: tuple[Path, Path], tmp_path: Path, monkeypatch, capsys) -> None:
    data, start = sft
    recipe = tmp_path / "grpo.toml"
    recipe.write_text(f'init_from = "{start}"\n{GRPO_RECIPE}kl_beta = 0.05\n')
    assert main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train_loss" in r]
    assert len(logged) == 6 and "val_loss" in rows[-1]
    for r in logged:
        assert 0.0 <= r["reward"] <= 1.0 and 1 <= r["completion_tokens"] <= 4 and r["kl"] >= 0
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference
    assert any(r["kl"] > 0 for r in logged[1:])
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("3+4=\n"))
    capsys.readouterr()
    assert main(["chat", str(tmp_path / "run"), "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_grpo_needs_prompts_one_per_window(sft: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    packed = arithmetic_data(tmp_path, packed=True)
    recipe = tmp_path / "grpo.toml"
    recipe.write_text(f'init_from = "{sft[1]}"\n{GRPO_RECIPE}')
    rc = main(["train", str(recipe), "--data", str(packed), "--out", str(tmp_path / "run"), "--quiet"])
    assert "prepare the records with --no-pack" in one_line_error(rc, capsys.readouterr().err)


def test_grpo_counts_the_rollout_rows_it_trained_on(sft: tuple[Path, Path], tmp_path: Path, monkeypatch) -> None:
    """tokens_seen and tokens/s are the rollouts' rows (prompt + completion, group_size per prompt, as the loss's
    forward runs them: padded to the micro-step's longest, its last token a target only), not the prompt windows."""
    from gptlab.checkpoint import list_step_checkpoints
    from gptlab.train.grpo import Grpo

    made: list[int] = []  # each micro-step's input tokens, from what the rollouts returned
    rollout = Grpo.rollout

    def recorded(self: Grpo, prompts: list[list[int]]) -> list[list[int]]:
        completions = rollout(self, prompts)
        lengths = [len(p) + len(c) for p, c in zip([p for p in prompts for _ in range(self.group)], completions,
                                                   strict=True)]
        made.append(len(lengths) * (max(lengths) - 1))
        return completions

    monkeypatch.setattr(Grpo, "rollout", recorded)
    data, start = sft
    recipe = tmp_path / "grpo.toml"
    recipe.write_text(f'init_from = "{start}"\n{GRPO_RECIPE}grad_accum = 2\ncompile = false\n'
                      "temperature = 0.8\nkl_beta = 0.05\n")  # the scoring at a temperature, its reference too
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet", "--max-steps", "3"]) == 0
    assert len(made) == 3 * 2
    per_step = [made[2 * s] + made[2 * s + 1] for s in range(3)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train_loss" in r]
    assert [r["tokens_seen"] for r in logged] == [sum(per_step[: r["step"]]) for r in logged]
    assert all(r["tokens_per_sec"] > 0 for r in logged)
    assert json.loads((list_step_checkpoints(run)[-1] / "state.json").read_text())["tokens_seen"] == sum(per_step)
    window = 24  # the prompt windows fed: 4 a step, 24 inputs each
    assert sum(per_step) != 3 * 4 * window


def test_a_reward_that_is_no_finite_number_is_one_line_naming_the_function(sft: tuple[Path, Path], tmp_path: Path,
                                                                        monkeypatch, capsys) -> None:
    """A nan reward would make its group's advantages nan and stop the run on a nan loss, blamed on the lr."""
    assert reward_value("m:f", 1) == 1.0 and reward_value("m:f", np.float32(0.5)) == 0.5
    for bad in (None, "1.0", math.inf, [1.0]):
        with pytest.raises(GptlabError, match=r"reward = 'm:f' returned .* a reward must be a finite number"):
            reward_value("m:f", bad)
    (tmp_path / "nan_reward.py").write_text("def score(prompt, completion, reference):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data, start = sft
    recipe = tmp_path / "grpo.toml"
    recipe.write_text(f'init_from = "{start}"\n{GRPO_RECIPE}reward = "nan_reward:score"\ncompile = false\n')
    capsys.readouterr()
    rc = main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "run"), "--quiet"])
    assert "reward = 'nan_reward:score' returned 'nan' for a completion" in one_line_error(rc, capsys.readouterr().err)



def test_rollouts_end_where_the_models_context_does(tmp_path: Path) -> None:
    """A RoPE model's generation slides on past block_size; a completion that did would make prompt + completion
    longer than the loss's forward takes: each is cut where the context ends, and the step trains."""
    from gptlab import GPT, GPTConfig
    from gptlab.data import read_meta
    from gptlab.train.batches import TokenSplit, targets_of
    from gptlab.train.grpo import Grpo

    data = arithmetic_data(tmp_path)
    split = TokenSplit.load(data, "train")
    window = split.window_tokens
    rows = np.asarray(split.tokens[: 4 * window], np.int64).reshape(4, window)
    x, y = targets_of(rows, np.asarray(split.mask[: 4 * window]).reshape(4, window))
    torch.manual_seed(0)
    model = GPT(GPTConfig(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", mlp_hidden=64, n_layer=1,
                          n_head=2, n_embd=32, vocab_size=int(read_meta(data)["vocab_size"]), block_size=32))
    cfg = build_train_config({"objective": "grpo", "group_size": 4, "max_new_tokens": 40, "batch_size": 4})
    grpo = Grpo(cfg, model, data)
    prompts = [p for p, _ in prompts_and_replies(x, y)]
    completions = grpo.rollout(prompts)
    lengths = [len(p) + len(c) for p, c in zip([p for p in prompts for _ in range(4)], completions, strict=True)]
    assert max(lengths) == 32 and all(len(c) >= 1 for c in completions)  # some ran into the context's end
    loss, stats = grpo.loss(model.train(), x, y, 1.0)
    assert torch.isfinite(loss) and stats.shape == (3,)
