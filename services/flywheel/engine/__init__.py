"""Embedded inference engine: SGLang's native HTTP API on Hugging Face transformers, for CPU.

Stands in for SGLang wherever SGLang cannot run (no GPU): the gateway, trainer and tests talk to
it exactly as to SGLang. Start it with `python -m flywheel.engine`.

Modules:
    convert   SmolLM2 GGUF -> safetensors folder (once, atomic); tiny random model for tests.
    protocol  request models, batch expansion, orjson-like JSON (torch-free).
    sampling  temperature / top-k / top-p / min-p, logprobs, seeded per-row sampling.
    sequence  one row's decode state: stops, finish reason, response object.
    runner    model + tokenizer: forward passes, checkpoint validation, in-place weight load.
    batcher   static batched decoding with a KV cache (left padding, pruning finished rows).
    worker    the thread that owns the model: queue, batch collection, aborts, weight swaps.
    metrics   Prometheus metrics.
    app       FastAPI routes with SGLang's shapes.
    main      settings -> worker -> uvicorn.
"""
