"""Reply parsing over generated text, pure Python (no jax, no quart: the server imports it too): stop strings,
think blocks, harmony messages, tool calls."""
