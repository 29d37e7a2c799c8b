"""Hugging Face interop: load `transformers` model directories as gptlab models and write gptlab models back.

    from gptlab.interop import from_hf, save_hf
    model = from_hf("path/to/hf-dir")  # GPT2LMHeadModel, LlamaForCausalLM or GPTNeoXForCausalLM
    save_hf(model, "out/hf-dir")  # loads with transformers.AutoModelForCausalLM.from_pretrained

Layout: `common` (config/weight reading, RoPE schemas, tensor rules), one module per family (`gpt2`, `llama`,
`neox`), `registry` (the list of families), `hf` (from_hf / save_hf), `peft` (LoRA adapters as a peft directory).
Importing never needs `transformers`.
"""

from gptlab.interop.hf import config_from_hf, config_to_hf, from_hf, save_hf, write_tokenizer
from gptlab.interop.peft import save_peft_adapter
from gptlab.interop.registry import SUPPORTED_ARCHITECTURES

__all__ = ["SUPPORTED_ARCHITECTURES", "config_from_hf", "config_to_hf", "from_hf", "save_hf", "save_peft_adapter",
           "write_tokenizer"]
