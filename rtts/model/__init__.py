"""Model layer: DualAR LLM, ModifiedDAC codec, tokenizers, prompts and checkpoint loading (torch only)."""
