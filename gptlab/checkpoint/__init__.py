"""Safe checkpoints: safetensors for tensors, JSON for everything else, written atomically. Never pickle.

A checkpoint is a directory:

    model.safetensors   the weights (tied weights stored once, no `_orig_mod.` prefixes)
    config.json         the GPTConfig
    lora.safetensors    (instead of model.safetensors, a LoRA run's checkpoints) only the adapters, fp32
    lora.json           with it: {"format": "gptlab-lora", "version", rank, alpha, dropout, targets,
                        "base": {"path", "sha256"}}: the frozen base the adapters belong to, and the sha256 of its
                        weight files, checked whenever the adapters are put back on it
    tokenizer files     whatever `Tokenizer.save` writes (optional)
    optimizer.safetensors  (training checkpoints) every optimizer's state tensors, flat: `opt{i}.{param}.{name}`
    state.json          (training checkpoints) step, elapsed_sec, best_val_loss, tokens_seen, the torch RNG
                        states (base64), config + config_hash, data_dir, and each optimizer's type, param groups
                        (hyper-parameters, peak_lr) and non-tensor state

A run directory (`gptlab train --out`) holds:

    .lock                         held (flock) by the `gptlab train` writing the run; holds its pid
    config.resolved.json          the training config, the model config, data dir, world size, device
    metrics.jsonl                 one JSON object per logged step (train_loss, lr, tokens_per_sec, mfu, val_loss)
    checkpoints/step-NNNNNNN/     the last `keep_last` training checkpoints
    checkpoints/best/             the best validation loss so far: weights, config, tokenizer, state.json

Writes go through a temporary directory swapped into place, so a crash leaves the previous checkpoint intact
and readers never see a partial one; reads name the damaged file in one line. Three modules, and callers import
from here:

    layout    the files' names, which directories hold a checkpoint, a run's step checkpoints, the plain model
              under torch.compile / DDP / FSDP wrappers
    writing   everything that puts a checkpoint on disk: a temporary directory swapped into place
    reading   everything that takes one back, checked: one-line errors naming the damaged file, and the one
              rule for loading weights (`load_weights`)

Which directory a path means (a run, a checkpoint, a Hugging Face directory) is `gptlab.loading`'s job.
"""

from gptlab.checkpoint.layout import (
    BEST_NAME,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LORA_CONFIG,
    LORA_FILE,
    LORA_FORMAT,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RESOLVED_CONFIG,
    STATE_FILE,
    STEP_NAME,
    TOKENIZER_FILES,
    has_weights,
    list_step_checkpoints,
    recorded_data_dir,
    recorded_setting,
    step_dir_name,
    unwrap_model,
)
from gptlab.checkpoint.reading import (
    assign_weights,
    check_floating,
    check_plain_shapes,
    load_adapter_tensors,
    load_gptlab_model,
    load_training_checkpoint,
    load_weights,
    optimizer_from_flat,
    plain_shapes,
    read_config,
    read_lora_config,
    read_tensors,
    read_training_state,
    stream_tensors,
    weights_sha256,
    with_tied_head,
)
from gptlab.checkpoint.writing import (
    model_state_dict,
    optimizer_to_flat,
    prune_checkpoints,
    save_checkpoint,
    save_model,
    save_tensors,
    whole,
    write_model,
)

__all__ = [
    "BEST_NAME", "CHECKPOINTS_DIR", "CONFIG_FILE", "LORA_CONFIG", "LORA_FILE", "LORA_FORMAT", "MODEL_FILE",
    "OPTIMIZER_FILE", "RESOLVED_CONFIG", "STATE_FILE", "STEP_NAME", "TOKENIZER_FILES", "assign_weights",
    "check_floating", "check_plain_shapes", "has_weights", "list_step_checkpoints", "load_adapter_tensors",
    "load_gptlab_model", "load_training_checkpoint", "load_weights", "model_state_dict", "optimizer_from_flat",
    "optimizer_to_flat", "plain_shapes", "prune_checkpoints", "read_config", "read_lora_config", "read_tensors",
    "read_training_state", "recorded_data_dir", "recorded_setting", "save_checkpoint", "save_model", "save_tensors",
    "step_dir_name", "stream_tensors", "unwrap_model", "weights_sha256", "whole", "with_tied_head", "write_model",
]
