"""Teacher service (on-policy distillation). Disabled by default: with `teacher.enabled = false`
the reward service writes straight to the trainer's stream."""
