"""Vocabulary fingerprints: the teacher scores the student's token ids only if ids mean the same
strings on both sides (field-failures BUG-23).

Student token ids are sent to the teacher as they are, never re-tokenized. That is only sound
when both tokenizers map every id to the same token string; otherwise id 123 means different
text to the teacher and its logprobs are garbage without any error. Cross-tokenizer distillation
(re-rendering and aligning spans by character offsets) is out of scope, so a mismatch is refused.
"""

from __future__ import annotations

import hashlib
import json
from typing import Protocol

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
            "distillation is not supported.")


def check_ids_in_vocab(ids: list[int], vocab_size: int) -> None:
    """Raise if any id is outside [0, vocab_size).

    Raises:
        VocabularyMismatchError: an id the teacher's vocabulary does not have.
    """
    bad = [i for i in ids if i < 0 or i >= vocab_size]
    if bad:
        raise VocabularyMismatchError(
            f"token ids {bad[:5]} are outside the teacher's vocabulary of {vocab_size}; the "
            "student uses a different tokenizer.")
