"""Helpers the tests share; no test file imports another (issue 42).

Here, used only by tests (`from support.X import ...`; tests/ is on the path as pytest's rootdir-relative
test directory, and tests/conftest.py registers the fixtures several files use):

    servers.py            a live `python -m imp_jax.server`, an in-process app, FakeEngine; the shared servers
    scripted_model.py     a user model whose greedy reply is a fixed token script (--model-class)
    otlp_receiver.py      a real OTLP/HTTP trace receiver on loopback
    metrics_text.py       reading a /metrics answer with prometheus-client's parser
    fuzz_bodies.py        Hypothesis strategies for hostile request bodies
    structured_schemas.py JSON schemas for the structured-output tests
    engine.py             driving an EngineCore: req, run (pool invariants checked), make_engine
    kv_tiers.py           a tiny-pool engine with the host KV tier, and its run
    smollm2.py            the real SmolLM2's greedy loop at one batch shape, chat prompt ids
    models.py             a model built from HF tensors as this host runs it; two models' parameters equal
    cpu_gemm.py           the int8-activation CPU GEMM: its NumPy rounding model, bounds, direct calls
    kernels.py            checks on the attention kernel's lowered program
    kquant_writer.py      Q4_K / Q6_K quantisers and SmolLM2 rewritten in llama.cpp's Q4_K_M layout
    gguf_models.py        the 2-layer mixed-type GGUF the loader tests read back
    moe_models.py         tiny Mixtral / Qwen-MoE directories and GGUFs (float, and random block stacks)
    gpt_oss_models.py     a tiny gpt-oss directory, random MXFP4 weights, its GGUF
    vision.py             test pictures (PIL gradients and noise, PNG colour bands)
    idefics3.py           a tiny Idefics3 / SmolVLM, its image layouts, an engine serving it (`vlm` fixture)
    qwen_vl.py            a tiny Qwen2.5-VL (`tiny_qwen` fixture) and its special token ids

In scripts/ (conftest.py puts it on the path), shared by tests and scripts, which never import tests:
tiny_models.py (tiny HF checkpoints, tokenizers), tiny_vlm.py (tiny VLM checkpoints), tiny_gguf.py (the one
GGUF writer, write_named_gguf, that every GGUF a test writes goes through; on it write_gguf_file: the loader's
name tables inverted; small vocabularies), quant_blocks.py (random GGML blocks),
attention_cases.py (attention kernel cases and a NumPy oracle), paged.py (PagedRunner: a model on ragged
chunks through the paged cache), loopback.py (a free port, waiting for a URL).

Entry points that stay beside the tests: tests/tp_check.py (the tensor-parallel child process) and
tests/user_model_example.py (the documented `--model-class user_model_example:OneLayerLM` example).
"""
