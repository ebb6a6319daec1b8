"""The trainer: consumes scored Samples, runs token-level RL steps, pushes weights to engines.

Layout (each module in one line):

    main.py / __main__.py   `python -m flywheel.trainer [--config FILE]`: settings, then the loop
    service.py              the loop: read -> assemble groups -> step -> checkpoint -> push -> ack
    groups.py               GroupAssembler: groups by group_id, admission and staleness drops
    samples.py              torch-free checks of one Sample (invariants, temperature, lag)
    leases.py               keeps entries held by the trainer from being reclaimed as idle
    batch.py                Samples -> right-padded (B, T) tensors and micro-batches
    logprobs.py             chunked selected-token logprobs of a causal LM at temperature T
    step.py                 one optimizer step: micro-batches, loss, backward, clip, AdamW, skip
    weights.py              model loading/resume, atomic checkpoints, weight push to engines
    telemetry.py            Prometheus metrics, JSONL metrics sink, status shared with HTTP
    http.py                 /healthz, /readyz, /status, /metrics
    algorithms/             pure advantage estimators, policy losses and aggregations (registries)

Nothing here imports torch at package import time; `main.py` imports it after settings parse.
"""
