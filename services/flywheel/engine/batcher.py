"""Continuous batching: one running batch whose rows join and leave between decode steps.

`RunningBatch` keeps every unfinished row's KV cache in one `DynamicCache` (B, heads, T, dim),
left-padded to a common width; the attention mask marks real tokens and each row keeps its own
position id (`cumsum(mask) - 1` at prefill, +1 per step), so a row's numbers do not depend on
its neighbours. Each `step()` samples one token for every row from the logits of the previous
forward pass, drops rows that finished (their cache rows too), and runs one forward pass over
the last sampled token of each remaining row.

`add()` prefills newly admitted rows together (their own left-padded pass, which also yields
their prompt logprobs), then merges their cache into the running one: the narrower of the two
caches is padded on the left (mask 0) and the batch dimension concatenated. Leading columns that
are padding in every row are trimmed after rows leave, so the width tracks the longest live row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
from torch import Tensor
from transformers import DynamicCache

from flywheel.engine.grammar import mask_logprobs
from flywheel.engine.runner import ModelRunner
from flywheel.engine.sampling import sample_tokens, tempered_logprobs, top_logprobs
from flywheel.engine.sequence import Sequence

_LOGIT_CHUNK = 512
"""Prompt positions projected to vocabulary logits at a time (bounds memory for long prompts)."""


class _KVLayer(Protocol):
    """A cache layer as the served models fill it: attention keys and values, both set."""

    keys: Tensor
    values: Tensor


def _kv_layers(cache: DynamicCache) -> list[_KVLayer]:
    """The layers of a prefilled cache: attention layers whose keys and values are tensors
    (transformers types them as any layer kind, not yet filled)."""
    return cast("list[_KVLayer]", cache.layers)


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor]:
    """Left-padded ids (B, T), attention mask (B, T) and position ids (B, T) from the mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


class RunningBatch:
    """The rows being decoded, their shared KV cache and the logits of their next token.

    Invariants: `len(seqs) == mask.shape[0] == positions.shape[0] == next_logits.shape[0]`,
    and every cache layer holds (B, heads, mask.shape[1] - 1 or mask.shape[1], dim) entries
    (the cache covers every token fed so far; the mask covers the same columns).
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seqs: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=runner.device)  # (B, T)
        self.positions = torch.zeros((0,), dtype=torch.long, device=runner.device)  # (B,)
        self.next_logits: Tensor | None = None  # (B, V) float32

    def __len__(self) -> int:
        return len(self.seqs)

    # -- rows joining ---------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill `seqs` (started sequences) and merge the unfinished ones into the batch.

        Rows already finished at start (prefill-only scoring, aborted while queued) still get
        their prompt logprobs; they are returned and never join.

        Returns:
            the rows that are finished after the prefill.
        """
        runner = self.runner
        with torch.inference_mode():
            ids, mask, positions = left_pad(
                [s.input_ids for s in seqs], runner.pad_id, runner.device
            )
            cache = runner.new_cache()
            hidden = runner.hidden(ids, mask, positions, cache)  # (B2, T2, H)
            for i, seq in enumerate(seqs):
                if seq.wants_input_logprobs:
                    _input_logprobs(runner, seq, hidden[i, ids.shape[1] - len(seq.input_ids) :])
            keep = [i for i, s in enumerate(seqs) if not s.finished]
            done = [s for s in seqs if s.finished]
            if not keep:
                return done
            index = torch.tensor(keep, dtype=torch.long, device=runner.device)
            logits = runner.logits(hidden[index, -1])  # (B2', V)
            if len(keep) < len(seqs):
                cache.batch_select_indices(index)
            self._merge([seqs[i] for i in keep], cache, mask[index], positions[index, -1], logits)
        return done

    def _merge(
        self,
        seqs: list[Sequence],
        cache: DynamicCache,
        mask: Tensor,
        last_pos: Tensor,
        logits: Tensor,
    ) -> None:
        if self.cache is None or not self.seqs:
            self.seqs, self.cache, self.mask = list(seqs), cache, mask
            self.positions, self.next_logits = last_pos, logits
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(_kv_layers(self.cache), _kv_layers(cache), strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)])
            old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.positions = torch.cat([self.positions, last_pos])
        assert self.next_logits is not None
        self.next_logits = torch.cat([self.next_logits, logits])
        self.seqs.extend(seqs)

    # -- one decode step ------------------------------------------------------------------------

    def step(self, on_token: Callable[[Sequence], None] | None = None) -> list[Sequence]:
        """Sample one token for every row, drop finished rows, feed the rest one position.

        Rows aborted since the last step finish with `abort` before sampling.

        Returns:
            the rows that finished in this step (their results are complete).
        """
        finished: list[Sequence] = []
        if not self.seqs:
            return finished
        with torch.inference_mode():
            for seq in self.seqs:
                seq.check_abort()
            finished += self._prune()
            if not self.seqs:
                return finished
            assert self.next_logits is not None
            tokens = _sample_step(self.runner, self.seqs, self.next_logits)  # (B,)
            if on_token is not None:
                for seq in self.seqs:
                    on_token(seq)
            before = self.seqs
            keep_tokens = self._prune_rows(tokens)
            finished += [s for s in before if s.finished]
            if self.seqs:
                self.next_logits = self._forward(keep_tokens)
        return finished

    def refresh_logits(self) -> None:
        """Recompute every row's next-token logits under the weights loaded now.

        The last cache column (the KV of each row's last fed token, computed under the weights
        of the previous forward pass) is dropped and that token is fed again, so the next
        sampled token comes from the current weights; the earlier columns are kept. Every row's
        last column is a real token (rows are right-aligned), so one (B, 1) forward pass does it.
        """
        if not self.seqs or self.cache is None:
            return
        with torch.inference_mode():
            last = [s.output_ids[-1] if s.output_ids else s.input_ids[-1] for s in self.seqs]
            for layer in _kv_layers(self.cache):
                layer.keys = layer.keys[:, :, :-1]
                layer.values = layer.values[:, :, :-1]
            self.mask = self.mask[:, :-1]
            self.positions = self.positions - 1
            tokens = torch.tensor(last, dtype=torch.long, device=self.mask.device)
            self.next_logits = self._forward(tokens)

    def finish_aborted(self) -> list[Sequence]:
        """Drop rows aborted while the batch is not stepping (paused); returns them."""
        for seq in self.seqs:
            seq.check_abort()
        return self._prune()

    def _prune(self) -> list[Sequence]:
        before = self.seqs
        if self.next_logits is not None and before:
            self.next_logits = self._prune_rows(self.next_logits)
        return [s for s in before if s.finished]

    def _prune_rows(self, rows: Tensor) -> Tensor:
        """Drop finished rows from the batch state and the cache; return `rows` of kept ones."""
        keep = [i for i, s in enumerate(self.seqs) if not s.finished]
        if len(keep) == len(self.seqs):
            return rows
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self.cache, self.next_logits = None, None
            self.mask = self.mask[:0]
            self.positions = self.positions[:0]
            return rows[index]
        assert self.cache is not None
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]
        self._trim()
        return rows[index]

    def _trim(self) -> None:
        """Drop leading columns that are padding in every remaining row."""
        live = self.mask.any(dim=0).nonzero()
        first = int(live[0]) if len(live) else 0
        if first == 0 or self.cache is None:
            return
        self.mask = self.mask[:, first:]
        for layer in _kv_layers(self.cache):
            layer.keys = layer.keys[:, :, first:]
            layer.values = layer.values[:, :, first:]

    def _forward(self, tokens: Tensor) -> Tensor:
        """Feed the last sampled token of every row; return next-token logits (B, V)."""
        assert self.cache is not None
        ones = torch.ones((len(tokens), 1), dtype=torch.long, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        self.positions = self.positions + 1
        hidden = self.runner.hidden(
            tokens.unsqueeze(1), self.mask, self.positions.unsqueeze(1), self.cache
        )
        return self.runner.logits(hidden[:, -1])


def _pad_left(x: Tensor, width: int) -> Tensor:
    """Zero-pad the sequence axis of a mask (B, T) or a cache tensor (B, heads, T, dim) left."""
    seq_dim = 1 if x.dim() == 2 else 2
    missing = width - x.shape[seq_dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[seq_dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=seq_dim)


def decode_batch(
    runner: ModelRunner,
    seqs: list[Sequence],
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Generate for `seqs` together until each one finishes (static batch; tests and tools).

    Args:
        runner: the model.
        seqs: started sequences (`Sequence.start()` called).
        on_step: called with the number of tokens sampled in each step.
    """
    batch = RunningBatch(runner)
    batch.add(seqs)
    while batch.seqs:
        rows = len(batch.seqs)
        batch.step()
        if on_step is not None:
            on_step(rows)


def _input_logprobs(runner: ModelRunner, seq: Sequence, hidden: Tensor) -> None:
    """Prompt logprobs from position L on: row 0 is null, row k scores input_ids[L + k]."""
    start = seq.job.spec.logprob_start_len
    k = seq.job.spec.top_logprobs_num
    ids = seq.input_ids
    seq.input_logprobs = [None] if start < len(ids) else []
    seq.input_top = [None] if start < len(ids) else []
    wanted = seq.job.spec.token_ids_logprob
    seq.input_ids_lp = [None] if start < len(ids) else []
    targets = torch.tensor(ids[start + 1 :], dtype=torch.long, device=hidden.device)
    for lo in range(start, len(ids) - 1, _LOGIT_CHUNK):
        hi = min(lo + _LOGIT_CHUNK, len(ids) - 1)
        logprobs = torch.log_softmax(runner.logits(hidden[lo:hi]), dim=-1)  # (C, V)
        chunk_targets = targets[lo - start : hi - start]
        picked = logprobs.gather(1, chunk_targets.unsqueeze(1)).squeeze(1)
        seq.input_logprobs.extend(picked.tolist())
        if k > 0:
            seq.input_top.extend(top_logprobs(row, k) for row in logprobs)
        if wanted:
            seq.input_ids_lp.extend(logprobs[:, wanted].tolist())


def _sample_step(runner: ModelRunner, seqs: list[Sequence], logits: Tensor) -> Tensor:
    """Sample one token per row; constrained rows draw from their grammar-masked distribution,
    every reported logprob is the unmasked `log_softmax(logits / T)` (engine/grammar.py), or
    the masked one for rows of `engine.grammar_logprobs = "renormalized"` (as SGLang)."""
    configs = [s.config for s in seqs]
    logprobs = tempered_logprobs(logits, configs)  # (B, V)
    draw = mask_logprobs(logprobs, [s.grammar for s in seqs])  # (B, V)
    tokens = sample_tokens(draw, configs, [s.generator for s in seqs])  # (B,)
    index = tokens.unsqueeze(1)
    picked = logprobs.gather(1, index).squeeze(1).tolist()
    picked_masked = draw.gather(1, index).squeeze(1).tolist() if draw is not logprobs else picked
    for i, (seq, token) in enumerate(zip(seqs, tokens.tolist(), strict=True)):
        reported = draw if seq.job.renormalized_logprobs else logprobs  # (B, V)
        if seq.job.spec.top_logprobs_num > 0:
            seq.output_top.append(top_logprobs(reported[i], seq.job.spec.top_logprobs_num))
        if seq.job.spec.token_ids_logprob:
            seq.output_ids_lp.append(reported[i, seq.job.spec.token_ids_logprob].tolist())
        value = picked_masked[i] if seq.job.renormalized_logprobs else picked[i]
        seq.append(token, value, runner.tokenizer)
        if seq.job.listener is not None and not seq.finished:
            notify(seq, runner)
    return tokens


def notify(seq: Sequence, runner: ModelRunner) -> None:
    """Send a streaming row its cumulative response; a listener that fails is dropped."""
    listener = seq.job.listener
    if listener is None:
        return
    try:
        listener(seq.result(runner.tokenizer))
    except Exception:  # the client's event loop is gone: nobody is listening any more
        seq.job.listener = None
