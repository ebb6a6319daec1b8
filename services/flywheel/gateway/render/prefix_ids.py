"""Token ids of rendered prompt prefixes seen recently, so a prompt that starts with one (the
same system prompt and tools as other sessions of an agent, or an earlier state of the same
conversation sent again without a session) tokenizes only the rest.

A prompt is cut only right after a turn separator, the tokenizer's end-of-turn special token
(e.g. `<|im_end|>`). A tokenizer splits special tokens out of the text before anything else, so
the ids of the text before such a cut followed by the ids of the text after it are exactly the
ids of the whole text: the rule `ChatRenderer.extend` already stitches recorded turns by.

Each prompt stores its prefix up to its last separator (and up to its first, the system prompt
that other conversations share); an entry a longer one was built from is dropped, so a growing
conversation keeps one entry. Bounded by memory (ids and prefix text), least recently used first
out.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

from flywheel.core.metrics import labeled_counter

log = logging.getLogger(__name__)

PROMPT_TOKENS = labeled_counter(
    "flywheel_gateway_prompt_tokens_total",
    "Tokens of fresh prompts (unrecorded requests, new segments), by how their ids were "
    "obtained: 'reused' from a cached prefix, 'encoded'",
    "how",
    ("reused", "encoded"),
)

ID_BYTES = 36
"""Memory of one cached id: its slot in the tuple (8) and its int object (28)."""

PROBES = 4
"""Latest separators tried as the end of a cached prefix (a conversation sent again with a reply
and a new message ends its previous prefix 2 or 3 separators back), besides the first."""


class PrefixIds:
    """`encode(text)` equal to `encode_fn(text)`, reusing the ids of cached prefixes.

    Thread-safe (long prompts are tokenized in worker threads).

    Args:
        encode_fn: text -> token ids (no special tokens added).
        separator: the special token after which prompts may be cut ("" = no cache).
        max_bytes: memory of all entries, as `entry_bytes` counts it; 0 = no cache.
    """

    def __init__(self, encode_fn: Callable[[str], list[int]], separator: str, max_bytes: int):
        self._encode = encode_fn
        self.separator = separator
        self.max_bytes = max_bytes if max_bytes > 0 and separator and self._splits_exactly() else 0
        self.size = 0
        """Bytes of all entries (`entry_bytes`)."""
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def _splits_exactly(self) -> bool:
        """Whether cutting after the separator keeps ids exact for this tokenizer (not for one
        that treats the start of the text specially, e.g. a SentencePiece-style tokenizer that
        prepends a space marker to the first word only); logged when it does not."""
        sep = self.separator
        for text in (f"Hi{sep}\nHello there{sep} world", f"x{sep}word{sep}  two\n{sep}é"):
            cut = text.find(sep) + len(sep)
            if self._encode(text) != self._encode(text[:cut]) + self._encode(text[cut:]):
                log.warning(
                    "prompt prefix cache off: this tokenizer's ids for text split after "
                    "%r differ from its ids for the whole text",
                    sep,
                )
                return False
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _cuts(self, text: str) -> list[int]:
        """Offsets right after each separator in `text`."""
        out, at, sep = [], text.find(self.separator), self.separator
        while at >= 0:
            out.append(at + len(sep))
            at = text.find(sep, at + len(sep))
        return out

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, exactly as `encode_fn(text)` gives them."""
        cuts = self._cuts(text) if self.max_bytes > 0 else []
        if not cuts:
            ids = self._encode(text)
            PROMPT_TOKENS.labels("encoded").inc(len(ids))
            return ids
        start, ids, reused = 0, [], 0
        for cut in [*reversed(cuts[-PROBES:]), *cuts[:1]]:
            prefix = text[:cut]
            with self._lock:
                hit = self._entries.get(prefix)
                if hit is not None:
                    self._entries.move_to_end(prefix)
            if hit is not None:
                start, ids, reused = cut, list(hit), len(hit)
                break
        # the entry this prompt grew from, unless it is a shared start (its first separator)
        grown_from = text[:start] if start > cuts[0] else ""
        if cuts[0] > start:  # the shared start (system prompt, tools)
            ids += self._encode(text[: cuts[0]])
            self._store(text[: cuts[0]], ids)
            start = cuts[0]
        if cuts[-1] > start:  # the conversation up to its last separator
            ids += self._encode(text[start : cuts[-1]])
            self._store(text[: cuts[-1]], ids, replaces=grown_from)
            start = cuts[-1]
        ids += self._encode(text[start:])
        PROMPT_TOKENS.labels("reused").inc(reused)
        PROMPT_TOKENS.labels("encoded").inc(len(ids) - reused)
        return ids

    def _store(self, prefix: str, ids: list[int], replaces: str = "") -> None:
        entry = tuple(ids)
        cost = entry_bytes(prefix, entry)
        if cost > self.max_bytes:
            return
        with self._lock:
            for key in (replaces, prefix):
                dropped = self._entries.pop(key, None) if key else None
                self.size -= entry_bytes(key, dropped) if dropped is not None else 0
            self._entries[prefix] = entry
            self.size += cost
            while self.size > self.max_bytes:
                key, evicted = self._entries.popitem(last=False)
                self.size -= entry_bytes(key, evicted)


def entry_bytes(prefix: str, ids: tuple[int, ...]) -> int:
    """Memory of one entry: the prefix text as Python stores it (1, 2 or 4 bytes a character)
    and `ID_BYTES` per id."""
    return sys.getsizeof(prefix) + ID_BYTES * len(ids)
