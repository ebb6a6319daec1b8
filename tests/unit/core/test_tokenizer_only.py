"""A process that marks torch absent (`without_torch`, as the gateway does) renders and
tokenizes exactly as one that imports torch, on the real SmolLM2 tokenizer, and never loads
torch. Each side runs in its own interpreter: torch, once imported, cannot be unloaded."""

import json
import subprocess
import sys
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[3] / "services"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 7 + 1? émojis 🚀 <|im_end|> inside"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 7, "b": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "8"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

PROGRAM = """
import json, sys
sys.path.insert(0, {services!r})
if {block}:
    from flywheel.core.tokenizer_only import without_torch
    assert without_torch()
from flywheel.gateway.render.tokenization import ChatRenderer
r = ChatRenderer({model!r})
messages, tools = json.loads({payload!r})
text = r.tokenizer.apply_chat_template(
    messages, tools=tools, tokenize=False, add_generation_prompt=True
)
libs = open("/proc/self/maps").read()
print(json.dumps({{
    "text": text,
    "ids": r.encode(text),
    "eos": r.eos_token_id,
    "torch_module": sys.modules.get("torch") is not None,
    "libtorch_mapped": "libtorch" in libs,
}}))
"""


def _render(model_dir: Path, block: bool) -> dict:
    payload = json.dumps([CONVERSATION, TOOLS])
    code = PROGRAM.format(
        services=str(SERVICES), block=block, model=str(model_dir), payload=payload
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tokenizer_without_torch_gives_the_same_text_and_ids(smollm2_dir):
    with_torch = _render(smollm2_dir, block=False)
    without = _render(smollm2_dir, block=True)
    assert with_torch["libtorch_mapped"]  # transformers 5 imports torch when it is installed
    assert not without["torch_module"] and not without["libtorch_mapped"]
    assert without["text"] == with_torch["text"]
    assert without["ids"] == with_torch["ids"]
    assert without["eos"] == with_torch["eos"] is not None
    assert len(without["ids"]) > 40  # the conversation, its tool call and tool result rendered


def test_without_torch_leaves_an_imported_torch_alone():
    code = (
        f"import sys; sys.path.insert(0, {str(SERVICES)!r}); import torch\n"
        "from flywheel.core.tokenizer_only import without_torch\n"
        "print(without_torch(), sys.modules['torch'] is torch)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == ["False", "True"]
