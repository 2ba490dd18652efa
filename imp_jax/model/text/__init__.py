"""Text in and out of a model: the tokenizer (HF or a GGUF's), chat templates, incremental detokenization."""
