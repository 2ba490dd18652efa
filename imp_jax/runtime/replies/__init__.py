"""Reply parsing over generated text, pure Python: stop strings, think blocks, harmony messages."""
