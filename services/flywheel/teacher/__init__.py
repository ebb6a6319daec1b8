"""Teacher service: on-policy distillation with hindsight hints (docs/architecture.md,
docs/sessions.md).

Reads the `scored` stream (group `teacher`), writes the `train` stream. For each Sample it finds
a hint (from the environment's task, or a judge LLM over the turn's next state), builds the
teacher context (the student's messages with the hint inserted), and scores the student's exact
sampled token ids under it by prefill on an SGLang-protocol teacher engine.

Modules: `vocab` (vocabulary fingerprints, cross-tokenizer refusal), `context` (teacher messages,
hint placement, the response span), `hints` (judge prompt, hint parsing, m votes, selection
rules), `scoring` (prefill-only /generate client with request batching and per-engine limits),
`pipeline` (one Sample through all of it), `worker` (the stream stage), `grpc_api`
(TeacherService + health + reflection), `metrics`, `main` (the entry point).
"""
