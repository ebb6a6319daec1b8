"""BUG-23: student ids are never scored by a teacher whose vocabulary differs."""

import pytest

from flywheel.teacher.vocab import (
    VocabularyMismatchError,
    check_ids_in_vocab,
    check_same_vocab,
    vocab_fingerprint,
)


class Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_same_vocabulary_same_fingerprint_regardless_of_dict_order():
    a = Tok({"a": 0, "b": 1, "<eos>": 2})
    b = Tok({"<eos>": 2, "b": 1, "a": 0})
    assert vocab_fingerprint(a) == vocab_fingerprint(b)
    assert vocab_fingerprint(a).startswith("v1:3:")
    check_same_vocab(vocab_fingerprint(a), vocab_fingerprint(b))


def test_same_size_different_mapping_is_refused():
    student = Tok({"a": 0, "b": 1})
    teacher = Tok({"a": 1, "b": 0})  # id 0 means "b" to the teacher
    with pytest.raises(VocabularyMismatchError, match="differs from the student"):
        check_same_vocab(vocab_fingerprint(student), vocab_fingerprint(teacher))


def test_real_tokenizers_of_different_families_differ(smollm2_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    smol = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert vocab_fingerprint(smol) != vocab_fingerprint(other)
    assert vocab_fingerprint(smol) == vocab_fingerprint(
        AutoTokenizer.from_pretrained(str(smollm2_dir))
    )


def test_ids_outside_the_teacher_vocabulary_are_refused():
    check_ids_in_vocab([0, 5, 9], 10)
    with pytest.raises(VocabularyMismatchError, match="outside"):
        check_ids_in_vocab([3, 10], 10)


def test_the_service_refuses_to_start_with_a_teacher_of_another_vocabulary(
    tiny_model_dir, tmp_path
):
    """BUG-23 at start-up: student SmolLM2 ids, teacher tokenizer of another family."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flywheel.core.settings import load_settings
    from flywheel.teacher.main import load_tokenizers

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    other.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    other.save_pretrained(tmp_path / "other")
    s = load_settings(teacher={"tokenizer_path": str(tmp_path / "other")})
    with pytest.raises(VocabularyMismatchError, match="differs from the student"):
        load_tokenizers(s, tiny_model_dir, tiny_model_dir)
    renderer, student, teacher = load_tokenizers(load_settings(), tiny_model_dir, tiny_model_dir)
    assert student == teacher == vocab_fingerprint(renderer.tokenizer)
