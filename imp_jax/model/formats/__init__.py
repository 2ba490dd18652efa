"""Checkpoint formats and loading: HF directories, GGUF files, converted (orbax) directories, PEFT adapters,
and the hub's aliases."""
