"""Vocabulary fingerprints: the teacher scores the student's token ids only if ids mean the same
strings on both sides (BUG-23).

Student token ids are sent to the teacher as they are, never re-tokenized. That is only sound
when both tokenizers map every id to the same token string; otherwise id 123 means different
text to the teacher and its logprobs are garbage without any error. Cross-tokenizer distillation
(re-rendering and aligning spans by character offsets) is out of scope, so a mismatch is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Protocol

import httpx

from flywheel.core.errors import ConfigurationError


class HasVocab(Protocol):
    def get_vocab(self) -> dict[str, int]: ...


class VocabularyMismatchError(ConfigurationError):
    """The teacher's vocabulary differs from the student's; scoring student ids is refused."""

    http_status = 400
    error_type = "invalid_request_error"


def vocab_fingerprint(tokenizer: HasVocab) -> str:
    """`v1:<size>:<sha256 prefix>` of the token -> id map (added tokens included)."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return f"v1:{len(vocab)}:{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


def check_same_vocab(student: str, teacher: str, *, where: str = "") -> None:
    """Raise unless the two fingerprints are equal.

    Raises:
        VocabularyMismatchError: they differ; the message says what to configure instead.
    """
    if student != teacher:
        raise VocabularyMismatchError(
            f"teacher vocabulary {teacher} differs from the student's {student}{where}: student "
            "token ids would mean different text to the teacher. Use a teacher of the same "
            "tokenizer family (same vocabulary), or disable the teacher; cross-tokenizer "
            "distillation is not supported."
        )


def check_ids_in_vocab(ids: list[int], vocab_size: int) -> None:
    """Raise if any id is outside [0, vocab_size).

    Raises:
        VocabularyMismatchError: an id the teacher's vocabulary does not have.
    """
    bad = [i for i in ids if i < 0 or i >= vocab_size]
    if bad:
        raise VocabularyMismatchError(
            f"token ids {bad[:5]} are outside the teacher's vocabulary of {vocab_size}; the "
            "student uses a different tokenizer."
        )


def probe_ids(vocab_size: int, n: int = 32) -> list[int]:
    """`n` ids spread over [1, vocab_size): e.g. vocab 49152, n 32 -> 1, 1536, 3071, ..."""
    step = max((vocab_size - 1) // n, 1)
    return list(range(1, vocab_size, step))[:n]


def check_served_vocab(
    url: str, tokenizer: Any, *, timeout_s: float = 30.0, wait_s: float = 300.0
) -> None:
    """Ask the engine at `url` which text its tokenizer gives `probe_ids` (a prefill with
    `return_text_in_logprobs`) and refuse an engine whose texts differ from `tokenizer`'s: the
    configured tokenizer paths agreeing says nothing about the model the engine actually serves.
    Waits up to `wait_s` seconds for an engine that does not answer yet, or answers 503 while
    it loads its model (a teacher started beside its engine, as containers are without health
    gating, must not take "loading" for another vocabulary).

    Raises:
        VocabularyMismatchError: the served vocabulary differs (or lacks a probe id).
        TimeoutError: the engine did not accept a connection, or still answered 503, within
            `wait_s`.
        httpx.TimeoutException: it accepted one but did not answer within `timeout_s`.
    """
    ids = probe_ids(len(tokenizer))
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 0},
    }
    deadline = time.monotonic() + wait_s
    while True:
        try:
            resp = httpx.post(f"{url.rstrip('/')}/generate", json=body, timeout=timeout_s)
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:  # not up yet
            last = repr(exc)
        else:
            if resp.status_code != 503:
                break
            last = f"HTTP 503 (loading): {resp.text[:200]}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"teacher engine {url} did not answer within {wait_s} s: {last}")
        time.sleep(1.0)
    if resp.status_code != 200:
        raise VocabularyMismatchError(
            f"teacher engine {url} refused the vocabulary probe ids {ids[:3]}...{ids[-1]} "
            f"(HTTP {resp.status_code}: {resp.text[:200]}); it serves another vocabulary"
        )
    rows = resp.json()["meta_info"]["input_token_logprobs"]
    served = [row[2] for row in rows]
    expected = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    # compared without surrounding whitespace: decoders differ in space clean-up, vocabularies
    # in the token itself
    differ = [
        (i, s, e)
        for i, s, e in zip(ids, served, expected, strict=True)
        if (s or "").strip() != e.strip()
    ]
    if differ:
        i, s, e = differ[0]
        raise VocabularyMismatchError(
            f"teacher engine {url} reads token id {i} as {s!r}, the teacher tokenizer as {e!r} "
            f"({len(differ)} of {len(ids)} probe ids differ): it serves a model of another "
            "vocabulary than teacher.tokenizer_path says. Point the teacher engine and "
            "teacher.tokenizer_path at the same model family."
        )
