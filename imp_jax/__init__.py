"""imp_jax: an LLM inference server in JAX."""

from imp_jax.runtime.request import SamplingParams  # noqa: E402


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing imp_jax must not load jax for the server's light modules
        from imp_jax.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
