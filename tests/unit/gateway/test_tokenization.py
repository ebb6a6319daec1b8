"""ChatRenderer.encode calls the Rust tokenizer directly: it must give exactly the ids of the
transformers tokenizer call it replaces, on the real SmolLM2 tokenizer, for text with special
tokens, whitespace runs, Unicode and template markup. And rendering stays on the event loop only
for short conversations."""

import asyncio
import threading

import pytest

from flywheel.gateway.render.tokenization import (
    INLINE_RENDER_CHARS,
    ChatRenderer,
    render_call,
    text_size,
)

TEXTS = [
    "What is 7 + 1?",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces   \n\n\ttabs",
    "émojis 🚀 and CJK 漢字, Ελληνικά",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
    "<|endoftext|> in the middle <|endoftext|>",
    "",
    "x" * 3000,
    # over INLINE_RENDER_CHARS: tokenized in a worker thread by `encode_batch` (GIL released)
    "Hello, world! <|im_end|>\n<|im_start|>user ü 数学 🙂  tabs\tand  spaces " * 400,
    "x" * 20_000,
]


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_direct_encode_equals_the_transformers_call(renderer, text):
    expected = list(renderer.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert renderer.encode(text) == expected
    assert renderer._fast is not None  # the direct path ran


def test_special_tokens_stay_single_ids(renderer):
    # "<|im_end|>" is one added token (id 2 in SmolLM2's vocabulary), not its characters
    assert renderer.encode("<|im_end|>") == [2]


def test_short_conversations_render_inline_and_long_ones_in_a_thread():
    def where() -> str:
        return threading.current_thread().name

    short = [{"role": "user", "content": "hi"}]
    long = [{"role": "user", "content": "y" * (INLINE_RENDER_CHARS + 1)}]
    assert text_size(short) == 2 and text_size(long) == INLINE_RENDER_CHARS + 1
    # tools and tool calls count too: 2 + len('[{"a": 1}]') = 2 + 10
    assert text_size(short, [{"a": 1}]) == 12

    async def run() -> tuple[str, str]:
        return (
            await render_call(text_size(short), where),
            await render_call(text_size(long), where),
        )

    inline, threaded = asyncio.run(run())
    assert inline == "MainThread" and threaded != "MainThread"
