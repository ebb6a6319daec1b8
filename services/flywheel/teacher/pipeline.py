"""One Sample through the teacher: hint -> teacher context -> prefill scoring -> Sample fields.

Output on the Sample (docs/sample.md): `teacher_logprobs` and `teacher_mask` with
len(token_ids) entries (logprob 0.0 and mask 0 wherever there is no teacher logprob), optional
`teacher_topk` / `teacher_topk_ids` / `teacher_topk_logprobs` (k per token, flattened, zeros where
absent), `hint`, `teacher_model`, `teacher_weight_version`, `wrong_hint` and
`wrong_hint_logprobs` (RLCSD, when the task gives a `wrong_hint`), and `teacher_status`:
- "scored": the last assistant turn's sampled tokens carry teacher logprobs (mask 1);
- "no_hint": no valid hint for this turn and `require_hint` is on (mask all 0; counted);
- "skipped: <reason>": nothing to score, or the Sample's temperature differs from the teacher's.

Temperature (the advantage needs both sides at the same temperature): teacher logprobs are at
temperature 1 (prefill logprobs are untempered on SGLang). Rollout logprobs are
log_softmax(logits / T) at the sampling temperature T, untempered for T = 1 and for greedy (T = 0,
SGLang reports raw logprobs). So Samples drawn at any other temperature are skipped with the
reason, never given a teacher - student gap that mixes temperatures.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from flywheel._proto import sample_pb2
from flywheel.core.errors import InvalidRequestError
from flywheel.teacher import metrics
from flywheel.teacher.context import (
    Placement,
    TeacherRenderer,
    insert_context,
    message_dicts,
    response_span,
    task_context,
    task_wrong_hint,
    turn_context,
)
from flywheel.teacher.hints import HintExtractor
from flywheel.teacher.scoring import ScoredTokens, TeacherScorer
from flywheel.teacher.vocab import check_ids_in_vocab

log = logging.getLogger(__name__)
TEACHER_TEMPERATURES = (0.0, 1.0)
"""Sampling temperatures whose rollout logprobs are untempered, like the teacher's."""


@dataclass(frozen=True)
class TeacherConfig:
    model_name: str
    """Recorded as `teacher_model` on each Sample."""
    top_k: int = 0
    """Top-k teacher logprobs per token; 0 = none."""
    placement: Placement = "last_user"
    require_hint: bool = True
    """No hint (from the task or the judge) -> no teacher logprobs, status "no_hint". Off = the
    turn is scored under the unhinted context (plain OPD with an external teacher)."""


class Teacher:
    """The teacher pipeline; thread-safe (several Samples may be in flight, batched together).

    Args:
        scorer: prefill client of the teacher engines.
        renderer: the teacher's tokenizer and chat template.
        config: what to write and how.
        hints: the hint judge; None = hints only from the task metadata.
    """

    def __init__(
        self,
        scorer: TeacherScorer,
        renderer: TeacherRenderer,
        config: TeacherConfig,
        hints: HintExtractor | None = None,
    ):
        self.scorer = scorer
        self.renderer = renderer
        self.config = config
        self.hints = hints

    def process(self, sample: sample_pb2.Sample) -> sample_pb2.Sample:
        """Fill the teacher fields of `sample` (in place) and return it.

        Raises:
            UpstreamError: the teacher engine failed after retries (the entry is retried later).
            ContractError: the engine's rows did not align (a poison sample or a broken engine).
            VocabularyMismatchError: a token id outside the teacher's vocabulary.
        """
        n = len(sample.token_ids)
        _clear(sample, n)
        temperature = sample.sampling.temperature
        if not any(math.isclose(temperature, t, abs_tol=1e-6) for t in TEACHER_TEMPERATURES):
            return self._skip(
                sample,
                f"sampled at temperature {temperature:g}; teacher "
                "logprobs are at temperature 1 (only T = 1 or greedy "
                "samples are comparable)",
            )
        span = response_span(list(sample.loss_mask))
        if span is None:
            return self._skip(sample, "no sampled tokens")
        try:
            context, _ = turn_context(message_dicts(sample.messages))
        except InvalidRequestError as exc:
            return self._skip(sample, str(exc))
        kind, text = self._hint(sample)
        if not text and self.config.require_hint:
            sample.teacher_status = "no_hint"
            metrics.SAMPLES.labels("no_hint").inc()
            log.info("sample %s: no valid hint for the turn; no teacher logprobs", sample.sample_id)
            return sample
        tools = json.loads(sample.tools_json) if sample.tools_json else None
        hinted = insert_context(context, text, self.config.placement, kind) if text else context
        start, end = span
        response_ids = list(sample.token_ids[start:end])
        check_ids_in_vocab(response_ids, self.renderer.vocab_size)
        scoring = self.scorer.submit(
            self.renderer.prompt_ids(hinted, tools), response_ids, self.config.top_k
        )
        wrong = task_wrong_hint(sample) if text else ""
        if wrong:  # submitted together, so both share a /generate call
            wrong_ctx = insert_context(context, wrong, self.config.placement, kind)
            contrast = self.scorer.submit(
                self.renderer.prompt_ids(wrong_ctx, tools), response_ids
            ).result()
        self._write(sample, start, scoring.result())
        if wrong:
            self._write_wrong(sample, start, wrong, contrast)
        return sample

    def _hint(self, sample: sample_pb2.Sample) -> tuple[str, str]:
        provided = task_context(sample)
        if provided is not None:
            kind, text = provided
            sample.hint = text if kind == "hint" else ""
            metrics.HINTS.labels("task").inc()
            return kind, text
        if self.hints is None:
            return "hint", ""
        result = self.hints.extract(sample)
        sample.hint = result.hint
        if not result.hint:
            log.info(
                "sample %s: hint extraction %s (%s)",
                sample.sample_id,
                result.status,
                "; ".join(v.reason for v in result.votes if v.decision is None) or "-",
            )
        return "hint", result.hint

    def _skip(self, sample: sample_pb2.Sample, reason: str) -> sample_pb2.Sample:
        sample.teacher_status = f"skipped: {reason}"
        metrics.SAMPLES.labels("skipped").inc()
        log.warning("sample %s not scored by the teacher: %s", sample.sample_id, reason)
        return sample

    def _write(self, sample: sample_pb2.Sample, start: int, scored: ScoredTokens) -> None:
        gaps = []
        for i, lp in enumerate(scored.logprobs):
            pos = start + i
            if math.isfinite(lp) and sample.loss_mask[pos] == 1:
                sample.teacher_logprobs[pos] = lp
                sample.teacher_mask[pos] = 1
                gaps.append(lp - sample.rollout_logprobs[pos])
        k = self.config.top_k
        if k:
            n = len(sample.token_ids)
            ids, lps = [0] * (k * n), [0.0] * (k * n)
            for i, (row_ids, row_lps) in enumerate(
                zip(scored.topk_ids, scored.topk_logprobs, strict=True)
            ):
                base = (start + i) * k
                for j, (tid, tlp) in enumerate(zip(row_ids, row_lps, strict=True)):
                    ids[base + j], lps[base + j] = tid, tlp if math.isfinite(tlp) else -1e30
            sample.teacher_topk = k
            sample.teacher_topk_ids.extend(ids)
            sample.teacher_topk_logprobs.extend(lps)
        sample.teacher_model = self.config.model_name
        sample.teacher_weight_version = scored.weight_version
        sample.teacher_status = "scored"
        metrics.SAMPLES.labels("scored").inc()
        metrics.TOKENS_SCORED.inc(len(gaps))
        if gaps:
            metrics.LOGPROB_GAP.observe(sum(gaps) / len(gaps))

    def _write_wrong(
        self, sample: sample_pb2.Sample, start: int, wrong: str, scored: ScoredTokens
    ) -> None:
        """Logprobs under the wrong hint; `teacher_mask` keeps only tokens that have both."""
        values = [0.0] * len(sample.token_ids)
        for i, lp in enumerate(scored.logprobs):
            if not math.isfinite(lp):
                sample.teacher_mask[start + i] = 0
            elif sample.teacher_mask[start + i]:
                values[start + i] = lp
        sample.wrong_hint = wrong
        sample.wrong_hint_logprobs.extend(values)


def _clear(sample: sample_pb2.Sample, n: int) -> None:
    """Reset the teacher fields (a redelivered Sample is processed afresh), zero-filled."""
    for name in (
        "teacher_logprobs",
        "teacher_mask",
        "teacher_topk_ids",
        "teacher_topk_logprobs",
        "wrong_hint_logprobs",
    ):
        sample.ClearField(name)  # type: ignore[arg-type]  # protobuf field names are dynamic
    sample.teacher_topk = 0
    sample.teacher_logprobs.extend([0.0] * n)
    sample.teacher_mask.extend([0] * n)
    for name in ("hint", "teacher_model", "teacher_weight_version", "teacher_status", "wrong_hint"):
        setattr(sample, name, "")


def summary(sample: sample_pb2.Sample) -> dict[str, Any]:
    """Teacher fields of a Sample for logs and tests."""
    return {
        "status": sample.teacher_status,
        "hint": sample.hint,
        "scored_tokens": sum(sample.teacher_mask),
        "model": sample.teacher_model,
        "weight_version": sample.teacher_weight_version,
    }
