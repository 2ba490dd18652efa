"""imp_jax: an LLM inference server in JAX."""
