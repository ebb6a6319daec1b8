"""Per-row stop rules and response rendering, with a one-char-per-token fake tokenizer."""

from __future__ import annotations

import torch

from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.sequence import Job, Sequence

ALPHABET = "abcdefghijklmnopqrstuvwxyz <>"
EOS = ALPHABET.index(">")


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids if not (skip_special_tokens and i == EOS))


def seq(max_new_tokens: int = 100, **params) -> Sequence:
    spec = RowSpec("r", None, [0], SamplingParams(**params), True, -1, 0, True)
    s = Sequence(
        Job(spec),
        [0],
        max_new_tokens=max_new_tokens,
        eos_ids=frozenset({EOS}),
        generator=torch.Generator(),
    )
    s.start()
    return s


def feed(s: Sequence, text: str) -> None:
    for ch in text:
        if s.finished:
            return
        s.append(ALPHABET.index(ch), -0.5, CharTokenizer())


def test_stop_string_far_into_the_output_is_found_and_trimmed():
    s = seq(stop=["xyz"])
    feed(s, "a" * 60 + "wxyzq")
    assert s.finish_reason == {"type": "stop", "matched": "xyz"}
    assert len(s.output_ids) == 60 + 4  # the token that completed the stop is kept
    assert s.text(CharTokenizer()) == "a" * 60 + "w"
    out = s.result(CharTokenizer())
    assert out["meta_info"]["output_token_logprobs"][-1] == [-0.5, ALPHABET.index("z"), "z"]


def test_no_stop_trim_keeps_the_stop_text():
    s = seq(stop="b c", no_stop_trim=True)
    feed(s, "ab cd")
    assert s.text(CharTokenizer()) == "ab c"


def test_eos_is_kept_in_ids_and_trimmed_from_text_unless_ignored():
    s = seq()
    feed(s, "ab>cd")
    assert s.output_ids == [0, 1, EOS]
    assert s.finish_reason == {"type": "stop", "matched": EOS}
    assert s.text(CharTokenizer()) == "ab"
    s = seq(max_new_tokens=4, ignore_eos=True)
    feed(s, "ab>cd")
    assert s.finish_reason == {"type": "length", "length": 4}


def test_abort_flag_and_prefill_only():
    s = seq(max_new_tokens=10)
    feed(s, "ab")
    s.job.aborted = True
    feed(s, "c")
    assert s.finish_reason["type"] == "abort"
    assert s.output_ids == [0, 1, 2]
    assert seq(max_new_tokens=0).finish_reason == {"type": "length", "length": 0}
