"""LoRA adapters as a peft adapter directory: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, DIR)` puts on the Hugging Face export of the same base.

peft adapts Hugging Face modules; gptlab adapts slices of its fused layers. The family's export `Rule` for a
fused weight says which rows of it become which Hugging Face tensor, so the same rule applied to an adapter's B
(one row per output row) splits it the same way: a Llama `c_attn` with q, k and v adapters becomes three
adapters on q_proj, k_proj and v_proj, each with its own A and B, exactly peft's layout. A Hugging Face module
fed by several targets (GPT-2's fused `c_attn`, GPT-NeoX's `query_key_value`) gets one adapter of rank
targets x r: A stacked, B block-diagonal, and its own rank and alpha in `rank_pattern` / `alpha_pattern` so that
alpha / rank stays the run's scaling. GPT-2's Conv1D modules take the same A and B (peft's `fan_in_fan_out`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gptlab.checkpoint import save_tensors, unwrap_model
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_dir
from gptlab.interop.common import Rule
from gptlab.interop.hf import export_family
from gptlab.lora import LoRALinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_adapter_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, int], bool]:
    """The adapters under peft's names, each Hugging Face module's rank, and whether they sit on Conv1Ds."""
    plain = unwrap_model(model)
    family = export_family(plain.config)
    rules: dict[str, Rule] = {rule.ours: rule for rule in family.rules(plain.config)}
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    conv1d = False
    for name, layer in plain.named_modules():
        if not isinstance(layer, LoRALinear):
            continue
        rule = rules[name + ".weight"]
        conv1d |= rule.transposes
        targets = list(layer.slices)
        r = layer.rank
        # B of the whole layer: (out, targets * r), block-diagonal over the targeted row slices
        b_full = torch.zeros(layer.out_features, len(targets) * r)
        for i, t in enumerate(targets):
            start, end = layer.slices[t]
            b_full[start:end, i * r : (i + 1) * r] = layer.lora_B[t].detach().float().cpu()
        # which targets feed each Hugging Face tensor: split an indicator of each target's rows the same way
        feeds: dict[str, list[int]] = {}
        for i, t in enumerate(targets):
            indicator = torch.zeros(layer.out_features, 1)
            start, end = layer.slices[t]
            indicator[start:end] = 1.0
            for hf_name, part in zip(rule.theirs, _split_rows(rule, indicator), strict=True):
                if part.any():
                    feeds.setdefault(hf_name, []).append(i)
        for hf_name, part in zip(rule.theirs, _split_rows(rule, b_full), strict=True):
            if hf_name not in feeds:
                continue  # no adapter on this module (e.g. only q targeted: k_proj and v_proj stay plain)
            used = feeds[hf_name]
            cols = torch.cat([torch.arange(i * r, (i + 1) * r) for i in used])
            module = "base_model.model." + hf_name.removesuffix(".weight")
            tensors[module + ".lora_A.weight"] = torch.cat([layer.lora_A[targets[i]].detach().float().cpu()
                                                            for i in used]).contiguous()
            tensors[module + ".lora_B.weight"] = part[:, cols].contiguous()
            ranks[hf_name.removesuffix(".weight")] = len(used) * r
    if not tensors:
        raise GptlabError("the model has no LoRA adapters to export")
    return tensors, ranks, conv1d


def _split_rows(rule: Rule, rows: torch.Tensor) -> list[torch.Tensor]:
    """`rule`'s split of a weight applied to a matrix with one row per output row (a Conv1D's transpose undone)."""
    if rule.transposes:
        return [p.t() for p in rule.split(rows)]
    return rule.split(rows)


def save_peft_adapter(model: torch.nn.Module, path: str | Path, base_model: str) -> Path:
    """Write `model`'s adapters as a peft LoRA directory for the Hugging Face model at `base_model`."""
    plain = unwrap_model(model)
    spec = getattr(plain, "lora_spec", None)
    if spec is None:
        raise GptlabError("the model has no LoRA adapters to export")
    tensors, ranks, conv1d = peft_adapter_tensors(plain)
    modules = sorted({name.rsplit(".", 1)[-1] for name in ranks})
    rank_pattern = {name: rank for name, rank in ranks.items() if rank != spec.rank}
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": modules,
        "rank_pattern": rank_pattern,
        # alpha / rank is the run's scaling for every module, whatever its rank
        "alpha_pattern": {name: spec.scaling * rank for name, rank in rank_pattern.items()},
        "fan_in_fan_out": conv1d,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }

    def write(tmp: Path) -> None:
        save_tensors(tensors, tmp / ADAPTER_WEIGHTS, {"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    return atomic_write_dir(path, write)
