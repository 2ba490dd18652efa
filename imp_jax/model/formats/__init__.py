"""Checkpoint formats and loading: HF directories, GGUF files, converted (orbax) directories, PEFT adapters,
the hub's aliases, and how weight matrices are stored once loaded."""
