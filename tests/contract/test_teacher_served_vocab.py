"""BUG-23 against a real engine process: the teacher checks which vocabulary each teacher engine
actually serves (probe ids echoed with their text), not only the configured tokenizer paths."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from flywheel.core.redis_server import free_port
from flywheel.teacher.vocab import VocabularyMismatchError, check_served_vocab, probe_ids


def test_probe_ids_spread_over_the_vocabulary():
    # (49152 - 1) // 32 = 1535: ids 1, 1536, 3071, ..., 1 + 31 * 1535 = 47586
    ids = probe_ids(49152)
    assert len(ids) == 32 and ids[:3] == [1, 1536, 3071] and ids[-1] == 47586
    assert probe_ids(3) == [1, 2]


def test_an_engine_serving_the_tokenizers_model_passes(shared_live_engine, tiny_model_dir):
    check_served_vocab(shared_live_engine, AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def test_an_engine_serving_another_vocabulary_of_the_same_size_is_refused(shared_live_engine):
    # Same size as SmolLM2's (49152 ids), other strings: a configured path could not tell.
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(49152)}, unk_token="w0"))
    other = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")
    with pytest.raises(VocabularyMismatchError, match="reads token id 1 as"):
        check_served_vocab(shared_live_engine, other)


def test_an_engine_that_never_answers_is_a_timeout(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with pytest.raises(TimeoutError, match="did not answer"):
        check_served_vocab(f"http://127.0.0.1:{free_port()}", tok, wait_s=0.5)
