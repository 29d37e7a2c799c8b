"""`TrainConfig`: every knob of `gptlab train`, each number's range beside its field, and `validate` for the
rules that tie fields together. `gptlab.train.recipe` reads it from a TOML recipe and command-line overrides.

No torch here: a recipe is checked before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from gptlab.checked import InvalidField, bounded, check_fields
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import json_digest
from gptlab.train.rewards import check_rollout_settings


class InvalidTrainKey(InvalidField, GptlabError):
    """A recipe key out of its range: both the one checked-field error and a GptlabError (exit 2, one line)."""


MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer init_from or eval_tasks entry names no file
MAX_DISTRIBUTED_TIMEOUT = 1e9  # seconds (31 years): a datetime.timedelta holds no more than ~8.6e13


@dataclass
class TrainConfig:
    """One training run's settings, all of them: what `config.resolved.json` records and what a resumed run
    must match (except RESUMABLE_CHANGES). Build it with `load_train_config` / `build_train_config`, which
    check every value; constructing it directly skips those checks."""

    # --- model ---
    model: str = "tiny"  # a preset name (`gptlab info` lists them); GPTConfig fields below it override it
    init_from: str | None = None  # fine-tune: a run, checkpoint or Hugging Face directory (replaces `model`)
    # --- LoRA (needs init_from): a frozen base, low-rank adapters on the `lora_targets` linears train ---
    lora_rank: int = bounded(0, int, low=0)  # 0 = full fine-tuning
    lora_alpha: float = bounded(16.0, low=0, low_open=True)  # the update is scaled by lora_alpha / lora_rank
    lora_dropout: float = bounded(0.0, low=0, high=1, high_open=True)  # dropout on the adapters' input
    lora_targets: str = "all-linear"  # comma-separated q,k,v,o,gate,up,down (or q_proj, ...), or all-linear
    quantize: Literal["int8", "int4"] | None = None  # QLoRA: the frozen base's block Linears as int8 / int4
    # --- objective: lm = next-token cross-entropy; dpo / ipo = preference pairs against the starting weights ---
    objective: Literal["lm", "dpo", "ipo", "simpo", "orpo", "grpo"] = "lm"  # simpo and orpo need no reference
    document_mask: bool = False  # lm: packed documents (ended by end-of-text) attend only within themselves
    # dpo / ipo: how far from the reference the policy may move; simpo: the reward scale; orpo: the odds-ratio term's
    # weight (trl's beta in each)
    beta: float = bounded(0.1, low=0, low_open=True)
    # dpo, simpo: the share of pairs taken to be mislabeled (conservative DPO)
    label_smoothing: float = bounded(0.0, low=0, high=0.5, high_open=True)
    # simpo: the reward margin the chosen reply must win by (trl's simpo_gamma)
    simpo_gamma: float = bounded(0.5, low=0)
    # every dropout off while training (the model's attention, residual and embedding dropout, LoRA's adapter
    # dropout; the checkpoint's config keeps them): "auto" = true for dpo / ipo / simpo / orpo (trl's DPO, CPO and
    # ORPO configs' default: the policy's log-probabilities are compared with the reference's, computed without
    # dropout), false for grpo (trl's GRPOConfig's: its ratio's old policy is the same forward pass); lm refuses
    # true (dropout is its regularizer: set dropout = 0 there)
    disable_dropout: bool | Literal["auto"] = "auto"
    # --- grpo: batch_size prompts a step, group_size sampled completions each, scored by `reward` (train/rewards) ---
    reward: str = "gptlab.train.rewards:exact_match"  # module:function(prompt, completion, reference) -> float
    group_size: int = bounded(8, int, low=2)  # advantages compare completions of one prompt
    max_new_tokens: int = bounded(16, int, low=1)  # per completion
    # the rollouts' sampling temperature, and the one their log-probabilities are scored at (trl's)
    temperature: float = bounded(1.0, low=0, low_open=True)
    # the policy ratio's clip range (trl's epsilon)
    clip_eps: float = bounded(0.2, low=0, high=1, low_open=True, high_open=True)
    # the weight of the KL to the starting weights (trl's beta; 0: no reference)
    kl_beta: float = bounded(0.0, low=0)
    # --- batch ---
    # sequences per optimizer step in total: split over processes and grad_accum micro-steps
    batch_size: int = bounded(32, int, low=1)
    # sequences per micro-step on each process (what fits a device): grad_accum becomes batch_size / (processes x
    # micro_batch_size), so one recipe keeps its global batch on 1 GPU or 16 (as litgpt's micro_batch_size)
    micro_batch_size: int | None = bounded(None, int, low=1, optional=True)
    # micro-steps per optimizer step; None = 1, or what micro_batch_size implies
    grad_accum: int | None = bounded(None, int, low=1, optional=True)
    # --- length of the run ---
    max_steps: int = bounded(1000, int, low=1)
    # seconds of training loop; when set the LR schedule follows elapsed time
    max_time: float | None = bounded(None, low=0, low_open=True, optional=True)
    # --- optimizer ---
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon on hidden matrices, AdamW on the rest
    lr: float = bounded(1e-3, low=0)  # AdamW's peak learning rate
    min_lr: float = bounded(0.0, low=0, high=1)  # where the decay ends, as a fraction of the peak learning rate
    warmup_steps: int = bounded(10, int, low=0)  # linear warm-up; the decay runs over the steps after it
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # wsd = warmup, stable, linear decay
    decay_fraction: float = bounded(0.5, low=0, high=1)  # wsd: the share of the run after warm-up spent decaying
    weight_decay: float = bounded(0.1, low=0)  # AdamW decay, on hidden matrices only
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = bounded(1e-8, low=0, low_open=True)
    # scaled per matrix by sqrt(max(1, rows/cols)) (torch's "original" adjust_lr_fn)
    muon_lr: float = bounded(0.02, low=0)
    muon_momentum: float = bounded(0.95, low=0, high=1, high_open=True)
    muon_nesterov: bool = True
    muon_weight_decay: float = bounded(0.0, low=0)
    # torch: torch.optim.AdamW(fused) + torch.optim.Muon; gptlab: the same updates (AdamW bit-identical) without
    # torch.optim's ~1 s import of torch._dynamo, and Muon batched over same-shape matrices (faster, small models)
    optimizer_impl: Literal["torch", "gptlab"] = "torch"
    grad_clip: float = bounded(1.0, low=0)  # global-norm clipping; 0 disables
    # --- evaluation, logging, checkpoints ---
    eval_interval: int = bounded(0, int, low=0)  # steps between validation passes; 0 = only at the end
    eval_tokens: int | None = bounded(None, int, low=1, optional=True)  # None = the whole validation split
    # windows per forward pass; None = about 4k tokens on CPU, 64k on GPU
    eval_batch_size: int | None = bounded(None, int, low=1, optional=True)
    log_interval: int = bounded(10, int, low=1)
    checkpoint_interval: int = bounded(0, int, low=0)  # steps between checkpoints; 0 = only at the end
    keep_last: int = bounded(2, int, low=1)  # step checkpoints kept (checkpoints/best/ is kept besides)
    tensorboard: bool = True  # also write TensorBoard events when `torch.utils.tensorboard` imports
    # experiment trackers sent metrics.jsonl's rows and the resolved config (`gptlab.train.trackers`); TOML: a
    # name or a list, command line: --tracker wandb,mlflow
    tracker: tuple[Literal["wandb", "mlflow", "tensorboard"], ...] = ()
    tracker_project: str = "gptlab"  # the wandb project / MLflow experiment the run is logged under
    # benchmarks scored during training (`gptlab.train.benchmarks`): multiple-choice .jsonl files, lm-eval task
    # names or task YAML files; every eval_tasks_interval steps (0 = only at the end), on at most eval_tasks_limit
    # examples per task (None = all)
    eval_tasks: tuple[str, ...] = ()
    eval_tasks_interval: int = bounded(0, int, low=0)
    eval_tasks_limit: int | None = bounded(None, int, low=1, optional=True)
    # --- execution ---
    # "auto": on a GPU bfloat16 where it has bf16 units (else float16, or float32); on a CPU float32 where bf16 is
    # emulated (no AVX512-BF16 or AMX), else the faster of the two at this run's shapes, measured (`autotune`)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    # under bf16/fp16, compute attention in fp32: "auto" = where `autotune` measures the dtype on a CPU, whichever
    # made bf16's step faster there; else on a CPU for heads narrower than 64 (its bf16 flash attention backward is
    # slower there; from 64 on bf16 is faster: README, "Training"), not on a GPU, where flash / cuDNN attention need
    # bf16/fp16 inputs (and fp32 GQA attention has no fused kernel at all)
    attention_fp32: bool | Literal["auto"] = "auto"
    # torch.compile the model: "auto" = on CUDA; on a CPU where a long run's measured compiled step is faster
    compile: bool | Literal["auto"] = "auto"
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~1/3 slower
    # with several processes (torchrun): ddp = every process holds the whole model, gradients all-reduced;
    # fsdp = parameters, gradients and optimizer state sharded over the processes (PyTorch's fully_shard)
    distributed: Literal["ddp", "fsdp"] = "ddp"
    # seconds a process waits in a collective for its peers before the run fails; None = torch's default (10
    # minutes under NCCL). A peer that died makes the others wait this long
    distributed_timeout: float | None = bounded(None, low=0, high=MAX_DISTRIBUTED_TIMEOUT, low_open=True, optional=True)
    seed: int = bounded(1337, int, low=0, high=2**63 - 1)
    device: str = "auto"  # auto = cuda when available, else cpu
    threads: int | None = bounded(None, int, low=1, optional=True)  # torch intra-op threads; None = torch's default
    # GPTConfig overrides given in the recipe or on the command line (filled by `load_train_config`)
    model_overrides: dict[str, Any] = field(default_factory=dict)

    def model_config(self, vocab_size: int | None = None) -> GPTConfig:
        """The GPTConfig: the preset with the overrides applied, and the data's vocabulary size if given."""
        fields = dict(self.model_overrides)
        if vocab_size is not None:
            fields["vocab_size"] = vocab_size
        try:
            return GPTConfig.preset(self.model, **fields)
        except ValueError as e:
            raise GptlabError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key, value in d.items():  # as JSON reads them back (a resumed run compares with its saved config)
            if isinstance(value, tuple):
                d[key] = list(value)
        return d

    def hash(self, ignore: frozenset[str] = frozenset()) -> str:
        d = {k: v for k, v in self.to_dict().items() if k not in ignore}
        return json_digest(d)


# Keys that may change when a run is resumed: they affect how long it runs and what it records, not the
# trajectory.
RESUMABLE_CHANGES = frozenset(
    {
        "max_steps",
        "max_time",
        "eval_interval",
        "eval_tokens",
        "eval_batch_size",
        "log_interval",
        "checkpoint_interval",
        "keep_last",
        "tensorboard",
        "tracker",
        "tracker_project",
        "eval_tasks",  # scored with the RNG set aside: the weights are the same with or without them
        "eval_tasks_interval",
        "eval_tasks_limit",
        "threads",
        "device",
        "compile",
        "distributed",  # checkpoints hold whole tensors either way
        "activation_checkpointing",  # recomputes the same activations
        "grad_accum",  # the same global batch, split otherwise (as on another number of processes)
        "micro_batch_size",
        "distributed_timeout",
    }
)


# What a run from before a key existed trained with, where that is not the key's default: such a checkpoint
# counts as this value (and a resumed "auto" resolves to it), so that it resumes as it trained.
PREDATED = {"disable_dropout": False}  # dropout ran in every objective before the key
# the objectives whose disable_dropout = "auto" means true (trl's DPOConfig, CPOConfig, ORPOConfig)
DROPOUT_OFF_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")


def resume_differences(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """The keys outside RESUMABLE_CHANGES whose value in a checkpoint's saved config differs from `cfg`'s. A key
    the checkpoint predates counts as its PREDATED value or else its default, so adding a key leaves older runs
    resumable."""
    defaults, now = {**TrainConfig().to_dict(), **PREDATED}, cfg.to_dict()
    return [k for k in now if k not in RESUMABLE_CHANGES and saved.get(k, defaults[k]) != now[k]]


def resolve_disable_dropout(cfg: TrainConfig, saved: dict[str, Any] | None = None) -> TrainConfig:
    """`cfg` with disable_dropout "auto" decided, as the run records it: a resumed run's as its checkpoint's
    `saved` config has it (one from before the key: false, its dropout ran), else by the objective."""
    if cfg.disable_dropout != "auto":
        return cfg
    value = saved.get("disable_dropout", PREDATED["disable_dropout"]) if saved is not None else None
    if not isinstance(value, bool):
        value = cfg.objective in DROPOUT_OFF_OBJECTIVES
    return dataclasses.replace(cfg, disable_dropout=value)


def micro_steps(cfg: TrainConfig, world: int) -> int:
    """grad_accum on `world` processes: as the recipe gives it, or batch_size / (world x micro_batch_size).
    Every process runs the same number of micro-steps of the same size, so the global batch must split evenly."""
    batch, micro, accum = cfg.batch_size, cfg.micro_batch_size, cfg.grad_accum
    if micro is None:
        accum = accum or 1
        if batch % (world * accum):
            raise GptlabError(f"batch_size {batch} does not split over {world} process(es) x grad_accum {accum}: "
                              f"make batch_size a multiple of {world * accum}, or set micro_batch_size instead")
        return accum
    if batch % (world * micro):
        raise GptlabError(f"batch_size {batch} does not split over {world} process(es) x micro_batch_size {micro}: "
                          f"make batch_size a multiple of {world * micro}, or lower micro_batch_size")
    derived = batch // (world * micro)
    if accum is not None and accum != derived:
        raise GptlabError(f"grad_accum {accum} disagrees with micro_batch_size {micro}: batch_size {batch} over "
                          f"{world} process(es) x micro_batch_size {micro} is grad_accum {derived}; set only one")
    return derived

def validate(cfg: TrainConfig) -> None:
    """One-line errors for values that have the right type but make no sense: every key is checked here,
    before any data is read or any step is taken, so that a run never trains to its end and then fails."""
    # nan or inf turns comparisons false, and would slip past every check below
    for name in (f.name for f in dataclasses.fields(cfg) if f.name != "model_overrides"):
        value = getattr(cfg, name)
        numbers = value if isinstance(value, tuple) else (value,)
        if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
            raise GptlabError(f"{name} must be a finite number, got {value}")
    check_fields(cfg, error=InvalidTrainKey)  # each number's range, written beside its field
    if cfg.warmup_steps >= cfg.max_steps:  # the run would end before its learning rate ever peaked
        raise GptlabError(f"warmup_steps ({cfg.warmup_steps}) must be less than max_steps ({cfg.max_steps}): "
                          "lower warmup_steps or raise max_steps")
    if not all(0.0 <= b < 1.0 for b in cfg.adam_betas):
        raise GptlabError(f"adam_betas must each be in [0, 1), got {list(cfg.adam_betas)}")
    for key, path in [("init_from", cfg.init_from or ""), *(("eval_tasks", t) for t in cfg.eval_tasks)]:
        if len(path) > MAX_PATH_CHARS:
            raise GptlabError(f"{key}: a path or name of {len(path)} characters (at most {MAX_PATH_CHARS})")
    if not cfg.device.strip():
        raise GptlabError("device must name a device: auto, cpu, cuda or cuda:N")
    # a batch that splits on no number of processes fails now; the trainer checks its own number of processes
    if cfg.micro_batch_size is not None and cfg.grad_accum is not None:  # together they imply the number
        if cfg.batch_size % (cfg.micro_batch_size * cfg.grad_accum):
            raise GptlabError(f"batch_size {cfg.batch_size} is not a multiple of micro_batch_size "
                              f"{cfg.micro_batch_size} x grad_accum {cfg.grad_accum}: set only one of them")
    else:
        micro_steps(cfg, 1)
    if cfg.lora_rank and not cfg.init_from:
        raise GptlabError("lora_rank needs a pretrained model to adapt: set init_from (a run, checkpoint or Hugging "
                          "Face directory)")
    if cfg.lora_rank and cfg.optimizer == "muon":
        raise GptlabError("LoRA adapters train with optimizer adamw (Muon orthogonalises whole matrices)")
    if cfg.quantize and not cfg.lora_rank:
        raise GptlabError(f"quantize = {cfg.quantize} quantizes a frozen base under LoRA adapters: set lora_rank")
    if cfg.document_mask and cfg.objective != "lm":
        raise GptlabError(f"document_mask applies to objective lm (packed documents), not {cfg.objective}")
    if cfg.disable_dropout is True and cfg.objective == "lm":  # nothing there compares two forward passes
        raise GptlabError("disable_dropout applies to objectives dpo, ipo, simpo, orpo and grpo, not lm, where "
                          "dropout is the model's regularizer: set dropout = 0 (and lora_dropout = 0) to train "
                          "without it")
    check_objective_keys(cfg)
    if cfg.objective != "lm" and cfg.distributed == "fsdp":
        raise GptlabError(f"objective {cfg.objective} runs on one process or under distributed = \"ddp\", not fsdp "
                          "(its reference model is not sharded)")
    if cfg.distributed == "fsdp" and cfg.optimizer == "muon":
        raise GptlabError("optimizer muon needs whole matrices, which distributed = \"fsdp\" shards: use "
                          "optimizer adamw, or distributed ddp")
    check_rollout_settings(cfg)
    cfg.model_config()  # an unknown preset or inconsistent model fields fail now, before any data is read


# keys that only some objectives read (trl's GRPOConfig calls its KL weight beta: here kl_beta)
OBJECTIVE_KEYS = {"beta": ("dpo", "ipo", "simpo", "orpo"), "label_smoothing": ("dpo", "simpo"),
                  "simpo_gamma": ("simpo",),
                  **dict.fromkeys(("reward", "group_size", "max_new_tokens", "temperature", "clip_eps", "kl_beta"),
                                  ("grpo",))}


def check_objective_keys(cfg: TrainConfig) -> None:
    """A key set away from its default under an objective that does not read it is refused, not ignored."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for key, objectives in OBJECTIVE_KEYS.items():
        if cfg.objective not in objectives and getattr(cfg, key) != defaults[key]:
            names = " and ".join([", ".join(objectives[:-1]), objectives[-1]] if len(objectives) > 1 else objectives)
            hint = ": GRPO's KL weight is kl_beta" if key == "beta" and cfg.objective == "grpo" else ""
            raise GptlabError(f"{key} applies to objective{'s' if len(objectives) > 1 else ''} {names}, not "
                              f"{cfg.objective}{hint}")


# the narrowest head whose attention runs faster in bf16 than in fp32 on a CPU through PyTorch's flash attention
# (forward + backward, the fp32 path's casts included, measured by process time: 0.6-0.7x at head sizes 32 and 48,
# 1.3-1.7x at 64 and 128). gptlab's own bf16 backward (`gptlab.causal_attention`) is faster than fp32 flash at 32
# too: 1.4x (AVX512-BF16) and 1.7x (AMX) at 32 x 2 heads x 64 x 32 on an AMX Xeon, forward included. The rule for
# "auto" where `autotune` did not time both (several processes, an explicit dtype); a resumed run keeps its choice.
BF16_ATTENTION_MIN_HEAD = 64


def resolve_device_switches(cfg: TrainConfig, device_type: str, head_size: int | None = None,
                            saved: dict[str, Any] | None = None, narrow_heads_bf16: bool = False) -> TrainConfig:
    """The recipe with its "auto" switches decided for a device type ("cpu", "cuda", ...), as the run records
    them: attention in fp32 on a CPU for heads narrower than `BF16_ATTENTION_MIN_HEAD` (`head_size`: the model's,
    init_from's, by default the recipe's preset's), unless `narrow_heads_bf16` (the caller found gptlab's bf16
    attention backward serving this model's heads on this CPU); a resumed run keeps its `saved` config's choice,
    so that it resumes exactly. torch.compile on CUDA, and not on a CPU where `autotune` left it undecided (a short
    run, or several processes)."""
    on_gpu = device_type == "cuda"
    attention_fp32 = cfg.attention_fp32
    if attention_fp32 == "auto" and saved is not None and isinstance(saved.get("attention_fp32"), bool):
        attention_fp32 = saved["attention_fp32"]
    elif attention_fp32 == "auto":
        narrow = (head_size or cfg.model_config().head_size) < BF16_ATTENTION_MIN_HEAD and not narrow_heads_bf16
        attention_fp32 = not on_gpu and narrow
    return dataclasses.replace(
        cfg, attention_fp32=attention_fp32,
        compile=on_gpu if cfg.compile == "auto" else cfg.compile)

