"""Scheduling: which sequences run each step under the token budget, the sequences themselves, their
device block tables, and the slots they hold besides KV blocks (LoRA adapters, image rows, pinned sessions)."""
