"""Model families as Flax NNX modules behind model/base.py's contract: the Llama decoder family, Gemma,
Phi-3, mixture-of-experts, gpt-oss, and the BERT encoders."""
