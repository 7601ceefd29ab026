"""The decoder (Llama, Qwen2, Qwen3) and the loaders for its weights."""
