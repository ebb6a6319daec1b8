"""Teacher context: the student's messages with a hint (or privileged context) inserted, rendered
with the teacher's own chat template and tokenizer; and the span of response tokens to score.

The response is the Sample's last run of sampled tokens (loss mask 1): the last assistant turn.
Those ids are scored exactly as the engine sampled them; only the context before them is
re-rendered, with the teacher's tokenizer. Earlier sampled segments of a multi-turn episode get
no teacher logprob (mask 0): the hint is about the last turn.

Placement rules (`TeacherSettings.hint_placement`):
- `last_user`: the hint is appended to the last user message, under a label line
  ("...\\n\\n[Hindsight hint]\\n<hint>"), as OpenClaw-RL's hindsight OPD does;
- `system_note`: the hint is appended to the first system message, or becomes a new system
  message at the front when there is none.

Environment-provided context (task metadata given when the session was created):
`task["hint"]` is used as the hint (no judge call); `task["privileged_context"]` (a reference
solution, say: on-policy self-distillation) is inserted by the same rule under its own label;
`task["wrong_hint"]` is a second, wrong hint for contrastive self-distillation (RLCSD): the
response is scored under it too (`wrong_hint_logprobs`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

from flywheel._proto import sample_pb2
from flywheel.core.errors import InvalidRequestError

Placement = Literal["last_user", "system_note"]
LABELS = {"hint": "[Hindsight hint]", "privileged_context": "[Privileged context]"}


def message_dicts(messages: Any) -> list[dict[str, Any]]:
    """OpenAI message dicts from `flywheel.v1.Message`s (content and extra fields from JSON)."""
    out = []
    for m in messages:
        extra = json.loads(m.extra_json) if m.extra_json else {}
        out.append({"role": m.role, "content": json.loads(m.content_json or "null"), **extra})
    return out


def response_span(loss_mask: list[int]) -> tuple[int, int] | None:
    """[start, end) of the last run of 1s in `loss_mask`; None when nothing was sampled.

    [0, 0, 1, 1, 0, 1, 1, 1] -> (5, 8); [0, 1, 1, 0] -> (1, 3); [0, 0] -> None.
    """
    end = len(loss_mask)
    while end > 0 and loss_mask[end - 1] != 1:
        end -= 1
    if end == 0:
        return None
    start = end
    while start > 0 and loss_mask[start - 1] == 1:
        start -= 1
    return start, end


def turn_context(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """(messages before the last assistant message, that message's text).

    Raises:
        InvalidRequestError: there is no assistant message (nothing to score).
    """
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise InvalidRequestError("the sample has no assistant message to score")
    return messages[:last], text_of(messages[last].get("content"))


def text_of(content: Any) -> str:
    """Plain text of an OpenAI content value (a string, a list of parts, or None)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return json.dumps(content)


def insert_context(
    messages: list[dict[str, Any]], text: str, placement: Placement, kind: str = "hint"
) -> list[dict[str, Any]]:
    """A copy of `messages` with `text` inserted by `placement` under the label of `kind`.

    Raises:
        InvalidRequestError: `last_user` with no user message.
    """
    out = copy.deepcopy(messages)
    block = f"{LABELS[kind]}\n{text.strip()}"
    if placement == "system_note":
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{text_of(out[0].get('content')).rstrip()}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
        return out
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if not users:
        raise InvalidRequestError("hint placement last_user needs a user message in the context")
    target = out[users[-1]]
    target["content"] = f"{text_of(target.get('content')).rstrip()}\n\n{block}"
    return out


def task_context(sample: sample_pb2.Sample) -> tuple[str, str] | None:
    """(kind, text) of environment-provided teacher context in the task metadata, else None.

    `privileged_context` wins over `hint` when both are given. A task that is not a JSON object
    provides nothing.
    """
    try:
        task = json.loads(sample.task_json or "{}")
    except json.JSONDecodeError:
        return None
    if not isinstance(task, dict):
        return None
    for kind in ("privileged_context", "hint"):
        value = task.get(kind)
        if isinstance(value, str) and value.strip():
            return kind, value.strip()
    return None


def task_wrong_hint(sample: sample_pb2.Sample) -> str:
    """`task["wrong_hint"]` (contrastive self-distillation, RLCSD), stripped; "" when absent."""
    try:
        task = json.loads(sample.task_json or "{}")
    except json.JSONDecodeError:
        return ""
    value = task.get("wrong_hint") if isinstance(task, dict) else None
    return value.strip() if isinstance(value, str) else ""


class TeacherRenderer:
    """The teacher's tokenizer and chat template (loaded from a Hugging Face folder).

    Args:
        tokenizer_path: folder with tokenizer files and a chat template.
    """

    def __init__(self, tokenizer_path: str | Path):
        from transformers import AutoTokenizer  # noqa: PLC0415  (heavy import after settings)

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        if not self.tokenizer.chat_template:
            raise InvalidRequestError(f"teacher tokenizer at {tokenizer_path} has no chat template")
        self.vocab_size = len(self.tokenizer.get_vocab())

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Teacher token ids of `messages` rendered with the generation prompt added.

        Raises:
            InvalidRequestError: the template rejects the conversation, or it renders empty.
        """
        messages = [{**m, "content": m.get("content") or ""} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:  # jinja2 raises TemplateError and plain exceptions
            raise InvalidRequestError(
                f"the teacher's chat template cannot render these messages: {exc}"
            ) from exc
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise InvalidRequestError("the teacher context renders to no tokens")
        return ids
