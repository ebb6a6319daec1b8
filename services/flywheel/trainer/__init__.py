"""The trainer: consumes scored Samples, runs token-level RL steps, pushes weights to engines.

Layout (each module in one line):

    main.py / __main__.py   `python -m flywheel.trainer [--config FILE]` (also under torchrun)
    service.py              the loop: read -> assemble groups -> step -> checkpoint -> push -> ack
    sources.py              where Samples come from: redis stream, replay of a dump, fake groups
    groups.py               GroupAssembler: groups by group_id, live samples, admission drops
    staleness.py            lag beyond max_staleness: drop, down-weight or IS-correct
    samples.py              torch-free checks of one Sample (invariants, temperature, lag)
    leases.py               keeps entries held by the trainer from being reclaimed as idle
    prepare.py              groups -> batch with advantages (group estimator; live per sample)
    batch.py                Samples -> right-padded (B, T) tensors and micro-batches (token budget)
    logprobs.py             chunked selected-token logprobs and entropy of a causal LM at T
    step.py                 one optimizer step: micro-batches, loss, KL, entropy, AdamW, skips
    distributed.py          torchrun data parallelism (rank 0 consumes; gradient all-reduce)
    weights.py              model loading/resume, atomic checkpoints, weight push to engines
    distributed_push.py     weight push over the engines' weight-update group (disk fallback)
    lora.py, export.py      LoRA adapters (peft); plain Hugging Face export of a checkpoint
    telemetry.py            Prometheus metrics, JSONL/TensorBoard/W&B sinks, status for HTTP
    http.py                 /healthz, /readyz, /status, /metrics
    algorithms/             pure advantage estimators, policy losses and aggregations (registries)

Nothing here imports torch at package import time; `main.py` imports it after settings parse.
"""
