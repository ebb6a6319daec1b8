"""Token ids of rendered prompt prefixes seen recently, so a prompt that starts with one (the
same system prompt and tools as other sessions of an agent, or an earlier state of the same
conversation sent again without a session) tokenizes only the rest.

A prompt is cut only right after a turn separator, the tokenizer's end-of-turn special token
(e.g. `<|im_end|>`). A tokenizer splits special tokens out of the text before anything else, so
the ids of the text before such a cut followed by the ids of the text after it are exactly the
ids of the whole text: the rule `ChatRenderer.extend` already stitches recorded turns by.

Each prompt stores its prefix up to its last separator (and up to its first, the system prompt
that other conversations share); an entry a longer one was built from is dropped, so a growing
conversation keeps one entry. Bounded by token count, least recently used first out.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from flywheel.core.metrics import labeled_counter

log = logging.getLogger(__name__)

PROMPT_TOKENS = labeled_counter(
    "flywheel_gateway_prompt_tokens_total",
    "Tokens of fresh prompts (unrecorded requests, new segments), by how their ids were "
    "obtained: 'reused' from a cached prefix, 'encoded'", "how", ("reused", "encoded"))

PROBES = 4
"""Latest separators tried as the end of a cached prefix (a conversation sent again with a reply
and a new message ends its previous prefix 2 or 3 separators back), besides the first."""


class PrefixIds:
    """`encode(text)` equal to `encode_fn(text)`, reusing the ids of cached prefixes.

    Thread-safe (long prompts are tokenized in worker threads).

    Args:
        encode_fn: text -> token ids (no special tokens added).
        separator: the special token after which prompts may be cut ("" = no cache).
        max_tokens: ids kept over all entries (about 40 bytes each with the prefix text);
            0 = no cache.
    """

    def __init__(self, encode_fn: Callable[[str], list[int]], separator: str, max_tokens: int):
        self._encode = encode_fn
        self.separator = separator
        self.max_tokens = max_tokens if separator and self._splits_exactly() else 0
        self.tokens = 0
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
                log.warning("prompt prefix cache off: this tokenizer's ids for text split after "
                            "%r differ from its ids for the whole text", sep)
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
        cuts = self._cuts(text) if self.max_tokens > 0 else []
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
            ids += self._encode(text[:cuts[0]])
            self._store(text[:cuts[0]], ids)
            start = cuts[0]
        if cuts[-1] > start:  # the conversation up to its last separator
            ids += self._encode(text[start:cuts[-1]])
            self._store(text[:cuts[-1]], ids, replaces=grown_from)
            start = cuts[-1]
        ids += self._encode(text[start:])
        PROMPT_TOKENS.labels("reused").inc(reused)
        PROMPT_TOKENS.labels("encoded").inc(len(ids) - reused)
        return ids

    def _store(self, prefix: str, ids: list[int], replaces: str = "") -> None:
        entry = tuple(ids)
        if len(entry) > self.max_tokens:
            return
        with self._lock:
            if replaces:
                dropped = self._entries.pop(replaces, None)
                self.tokens -= len(dropped) if dropped is not None else 0
            old = self._entries.pop(prefix, None)
            self.tokens -= len(old) if old is not None else 0
            self._entries[prefix] = entry
            self.tokens += len(entry)
            while self.tokens > self.max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self.tokens -= len(evicted)
