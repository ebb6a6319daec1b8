"""Embedded inference engine: SGLang's HTTP API on Hugging Face transformers (CPU, or CUDA).

Stands in for SGLang wherever SGLang cannot run (no GPU): the gateway, reward judge, teacher,
trainer and tests talk to it exactly as to SGLang. Start it with `python -m flywheel.engine`.

Modules:
    convert        SmolLM2 GGUF -> safetensors folder (once, atomic); tiny random model for tests.
    protocol       /generate request models, batch expansion, orjson-like JSON (torch-free).
    openai_api     /v1 request models and chat/completion response shapes (torch-free).
    sampling       temperature / top-k / top-p / min-p, logprobs, seeded per-row sampling.
    sequence       one row's decode state: stops, finish reason, weight-version spans, response.
    runner         model + tokenizer on the picked device: forward passes, checkpoint checks.
    batcher        continuous batching: rows join and leave a running batch between steps.
    scheduler      the worker's inbox: admission order, draining vs urgent controls, pause.
    worker         the thread that owns the model: submit, abort, pause, decode loop, health.
    weights        weight updates from disk and over torch.distributed (SGLang's rank layout,
                   `emulate_tp_size` ranks); weight reads.
    metrics        Prometheus metrics.
    app            native SGLang routes; openai_routes the /v1 routes; weight_routes the
                   distributed weight-update routes.
    main           settings -> worker -> uvicorn.
"""
