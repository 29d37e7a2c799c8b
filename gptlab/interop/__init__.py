"""Hugging Face interop: load `transformers` model directories as gptlab models and write gptlab models back.

    from gptlab.interop import from_hf, save_hf
    model = from_hf("path/to/hf-dir")  # GPT2LMHeadModel, LlamaForCausalLM or GPTNeoXForCausalLM
    save_hf(model, "out/hf-dir")  # loads with transformers.AutoModelForCausalLM.from_pretrained

Layout: `common` (config/weight reading, RoPE schemas, tensor rules), one module per family (`gpt2`, `llama`,
`neox`), `registry` (the list of families), `hf` (from_hf / save_hf), `peft` (LoRA adapters as a peft directory),
`hub` (fetching a model from the Hugging Face Hub: `gptlab download`).
Importing never needs `transformers`.
"""

from typing import TYPE_CHECKING

from gptlab.lazy import lazy_exports

if TYPE_CHECKING:
    from gptlab.interop.hf import config_from_hf, config_to_hf, from_hf, save_hf, write_tokenizer
    from gptlab.interop.peft import save_peft_adapter
    from gptlab.interop.registry import SUPPORTED_ARCHITECTURES

# imported on first use: `gptlab download` (interop.hub) needs no torch
_LAZY = {
    "SUPPORTED_ARCHITECTURES": "gptlab.interop.registry",
    "config_from_hf": "gptlab.interop.hf",
    "config_to_hf": "gptlab.interop.hf",
    "from_hf": "gptlab.interop.hf",
    "save_hf": "gptlab.interop.hf",
    "save_peft_adapter": "gptlab.interop.peft",
    "write_tokenizer": "gptlab.interop.hf",
}
__all__ = ["SUPPORTED_ARCHITECTURES", "config_from_hf", "config_to_hf", "from_hf", "save_hf", "save_peft_adapter",
           "write_tokenizer"]
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
