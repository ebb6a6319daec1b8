"""Prompt prefix ids: a fresh prompt that starts like a recent one reuses that prefix's ids and
gets exactly the ids the tokenizer gives the whole prompt (real SmolLM2 tokenizer and template;
the cache's bookkeeping on a character-level fake tokenizer)."""

from __future__ import annotations

import random

import pytest

from flywheel.gateway.render.prefix_ids import PROMPT_TOKENS, PrefixIds, entry_bytes
from flywheel.gateway.render.tokenization import ChatRenderer


def _tokens() -> dict[str, float]:
    return {h: PROMPT_TOKENS.labels(h)._value.get() for h in ("reused", "encoded")}


class CharTokenizer:
    """One id per character (ord), so the arithmetic below is easy to follow; logs its calls."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.calls.append(text)
        return [ord(c) for c in text]


def _cost(prefix: str) -> int:
    """An entry's bytes with the character tokenizer (one id per character)."""
    return entry_bytes(prefix, tuple(range(len(prefix))))


def test_a_prompt_reuses_its_longest_cached_prefix_and_encodes_only_the_rest():
    enc = CharTokenizer()
    ids = PrefixIds(enc, "|", max_bytes=10_000)
    enc.calls.clear()  # the start-up check of the split rule
    first = "sys|u1|a"  # separators end at offsets 4 ("sys|") and 7 ("sys|u1|")
    assert ids.encode(first) == [ord(c) for c in first]
    assert enc.calls == ["sys|", "u1|", "a"]  # cut at the first and the last separator
    assert len(ids) == 2 and ids.size == _cost("sys|") + _cost("sys|u1|")
    enc.calls.clear()
    second = "sys|u1|a1|u2|a"  # the same conversation, a reply and a message later
    assert ids.encode(second) == [ord(c) for c in second]
    assert enc.calls == ["a1|u2|", "a"]  # "sys|u1|" came from the cache (7 ids)
    # "sys|u1|a1|u2|" replaced "sys|u1|", which it grew from; "sys|" stays shared
    assert set(ids._entries) == {"sys|", "sys|u1|a1|u2|"}
    assert ids.size == _cost("sys|") + _cost("sys|u1|a1|u2|")
    enc.calls.clear()
    other = "sys|v1|a"  # another conversation with the same system prompt
    assert ids.encode(other) == [ord(c) for c in other]
    assert enc.calls == ["v1|", "a"]
    assert ids.size == _cost("sys|") + _cost("sys|u1|a1|u2|") + _cost("sys|v1|")


def test_an_entry_costs_its_ids_and_its_text_as_python_stores_it():
    # 36 bytes per id; the text: sys.getsizeof, 1 byte a character for ASCII, 4 with an emoji
    assert entry_bytes("ab|", (1, 2, 3)) - entry_bytes("", ()) == 3 * 36 + 3
    wide = "🙂" + "-" * 99 + "|"
    assert entry_bytes(wide, (1,)) - entry_bytes("🙂", ()) >= 100 * 4


def test_text_without_a_separator_or_without_a_budget_is_encoded_whole():
    enc = CharTokenizer()
    for cache, text in (
        (PrefixIds(enc, "|", 10_000), "no separator"),
        (PrefixIds(enc, "|", 0), "a|b"),
        (PrefixIds(enc, "", 10_000), "a|b"),
    ):
        enc.calls.clear()
        assert cache.encode(text) == [ord(c) for c in text]
        assert enc.calls == [text]


def test_a_tokenizer_that_marks_the_start_of_its_text_gets_no_cache(caplog):
    """A SentencePiece-style tokenizer puts a word-start marker before the first word only: ids
    of a text split after the separator would differ from the whole text's, so no cache."""

    def first_word_marked(text: str) -> list[int]:
        return [0x2581, *[ord(c) for c in text]]  # "▁" + the characters

    cache = PrefixIds(first_word_marked, "|", 10_000)
    assert cache.max_bytes == 0 and "prompt prefix cache off" in caplog.text
    assert cache.encode("a|b") == first_word_marked("a|b") and len(cache) == 0


def test_the_cache_keeps_the_most_recently_used_prefixes_within_its_budget():
    budget = 2 * _cost("aaaa|")
    ids = PrefixIds(CharTokenizer(), "|", max_bytes=budget)
    ids.encode("aaaa|x")  # stores "aaaa|"
    ids.encode("bbbb|x")  # stores "bbbb|": the budget is full
    ids.encode("aaaa|y")  # a hit: "aaaa|" is now the most recent
    ids.encode("cccc|x")  # over budget: "bbbb|", the least recently used, goes
    assert set(ids._entries) == {"aaaa|", "cccc|"} and ids.size == budget
    ids.encode("d" * 20 + "|x")  # a prefix over the whole budget is not kept
    assert set(ids._entries) == {"aaaa|", "cccc|"}


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def _content(rng: random.Random) -> str:
    pieces = [
        "Hello",
        " world",
        "\n\n",
        "  leading spaces",
        "tabs\tand\ttabs",
        "émigré café",
        "数学 题",
        "🙂 emoji",
        "<|im_start|>",
        "<|im_end|>",
        "x" * 50,
        "12345",
        "\n",
        " trailing ",
        "def f(x):\n    return x",
        '{"json": [1, 2]}',
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))


def test_prompt_ids_are_exactly_the_tokenizers_for_growing_and_shared_conversations(renderer):
    """200 prompts: 10 conversations with one system prompt, each sent again 20 times as it
    grows (what an agent without a session sends); every prompt's ids must equal the
    tokenizer's ids for the whole rendering, with most of them reused from the cache."""
    rng = random.Random(7)
    before = _tokens()
    system = {"role": "system", "content": "You are a careful agent. " + _content(rng)}
    for _ in range(10):
        messages = [system, {"role": "user", "content": _content(rng)}]
        for _ in range(20):
            text = renderer.render(messages)
            assert renderer.prompt_ids(messages) == renderer.encode(text), text
            messages += [
                {"role": "assistant", "content": _content(rng)},
                {"role": "user", "content": _content(rng)},
            ]
    after = _tokens()
    reused, encoded = (after[h] - before[h] for h in ("reused", "encoded"))
    assert reused > 3 * encoded  # most prompt tokens came from the cache


def test_unrecorded_requests_of_a_growing_conversation_send_the_tokenizers_ids(
    redis_client, prefix, renderer, smollm2_dir
):
    """Through the gateway without a session (the openai SDK's usual traffic): the engine gets
    the ids a cache-less renderer computes for each whole prompt, most of them reused."""
    from .harness import gateway_app
    from .test_live import ScriptEngine

    engine = ScriptEngine(renderer, ["Paris.", "Lyon.", "Nice."])
    client, _, _ = gateway_app(redis_client, prefix, renderer, engine)
    plain = ChatRenderer(smollm2_dir, prefix_cache_bytes=0)
    messages = [
        {"role": "system", "content": "You plan trips. " * 40},
        {"role": "user", "content": "Where to?"},
    ]
    before = _tokens()
    for turn in range(5):
        resp = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
        assert resp.status_code == 200, resp.text
        assert engine.calls[-1][0] == plain.encode(plain.render(messages))
        messages += [
            resp.json()["choices"][0]["message"],
            {"role": "user", "content": f"And then {turn}?"},
        ]
    reused = _tokens()["reused"] - before["reused"]
    # turns 2-5 reuse at least the system prompt (over 160 tokens each)
    assert reused > 4 * 160, reused
