"""Decoder hidden states with each shared prompt computed once (`trainer.batch.layout =
"shared_prefix"`).

The samples of a GRPO group share their prompt token for token: a padded micro-batch of one
group runs the decoder over the prompt B times. Here the rows of a micro-batch are clustered by
common prefix; each cluster's prefix runs once (batch 1, keeping its key/value cache), the cache
is repeated B_c times along the batch, and only the rows' own suffixes run on top of it. Autograd
flows through the repeated cache into the single prefix pass, so the gradient of the prefix is
the sum over the rows, exactly as in the padded pass: the same loss and gradients up to float
rounding (fp32: relative gradient difference about 1e-5, tests/unit/trainer/test_shared_prefix.py).

Cost per cluster: P + sum_b S_b decoder positions instead of B (P + max_b S_b), plus the
padding of the suffix passes: the suffixes run in passes of rows of similar length
(`length_buckets`), so one long reply does not pad every short one to its length. Example: the
demo's prompt is 44 tokens and replies 3-32 tokens; a group of 8 with 6-token replies runs
44 + 8 x 6 = 92 positions instead of 8 x 50 = 400; with seven 3-token replies and one of 32,
44 + 7 x 3 + 32 = 97 in two suffix passes instead of 44 + 8 x 32 = 300 in one.

Rows that share fewer than `min_prefix` tokens with every other row run together as a plain
padded pass, so a batch without shared prompts costs what the padded layout costs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers
from torch import Tensor

from flywheel.trainer.grad_sinks import input_embeddings

CACHE_KEYWORD = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"
"""The decoder's key/value cache argument and output field (renamed in transformers 5)."""
MIN_PREFIX = 16
"""Tokens two rows must share from the start to share one prefix pass."""
BUCKET_OVERHEAD = 16
"""A suffix pass's fixed cost in decoder positions, for `length_buckets`: splitting a cluster
into one more pass must save at least this much padding."""


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists.

    Example: [1, 2, 3, 9] and [1, 2, 4] -> 2."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prefix_clusters(
    rows: list[list[int]], min_prefix: int = MIN_PREFIX
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Cluster rows by shared prefix: ([(row indices, prefix length P)], rows alone).

    A row joins the first cluster whose first row shares at least `min_prefix` tokens with it
    (greedy, in row order). P is the common prefix of all the cluster's rows, capped at the
    shortest row's length - 1 so every row keeps at least one token of its own (the suffix
    pass needs one). Clusters of one row, or whose P falls below `min_prefix`, go to the rows
    run alone.

    Example, min_prefix 2: rows [1,2,3,4], [1,2,3,5,6], [7,8], [1,2,9] -> cluster (0, 1, 3)
    with P = 2 (row 3 differs at index 2), row 2 alone: ([([0, 1, 3], 2)], [2]).
    """
    heads: list[list[int]] = []
    members: list[list[int]] = []
    for index, row in enumerate(rows):
        for c, head in enumerate(heads):
            if common_prefix_length(head, row) >= min_prefix:
                members[c].append(index)
                break
        else:
            heads.append(row)
            members.append([index])
    clusters: list[tuple[list[int], int]] = []
    alone: list[int] = []
    for head, member in zip(heads, members, strict=True):
        shared = min(common_prefix_length(head, rows[i]) for i in member)
        shared = min(shared, min(len(rows[i]) for i in member) - 1)
        if len(member) > 1 and shared >= min_prefix:
            clusters.append((member, shared))
        else:
            alone.extend(member)
    return clusters, sorted(alone)


def right_padded_lengths(attention_mask_BT: Tensor, layout: str = "shared-prefix") -> list[int]:
    """Each row's number of real tokens (`layout` names the caller in the error).

    Raises:
        ValueError: the attention mask is not right padding (real tokens first in every row).
    """
    real_BT = attention_mask_BT.bool()
    position_BT = real_BT.long().cumsum(dim=1) - 1
    columns_BT = torch.arange(real_BT.shape[1], device=real_BT.device).expand_as(position_BT)
    if not bool((position_BT[real_BT] == columns_BT[real_BT]).all()):
        raise ValueError(f"{layout} logprobs need right-padded rows (real tokens first)")
    return [int(n) for n in real_BT.sum(dim=1).tolist()]


def shared_prefix_hidden(
    decoder: Any,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    min_prefix: int = MIN_PREFIX,
) -> Tensor:
    """(B, T, H) last hidden states of the decoder, each cluster's shared prefix run once.

    Positions are those of the padded pass (0..L_b - 1 per row, right padding), so the
    hidden states at real tokens equal the decoder's (`logprobs.decoder_of`) padded ones up
    to float rounding; padded positions hold unspecified values (callers read real ones only).

    Args:
        decoder: a causal LM's decoder stack (`logprobs.decoder_of`), with a key/value cache
            (`DynamicCache`).
        input_ids_BT: (B, T) int64 token ids, right-padded.
        attention_mask_BT: (B, T) int64/bool, 1 on real tokens, right padding only.

    Raises:
        ValueError: the attention mask is not right padding.
    """
    lengths = right_padded_lengths(attention_mask_BT)
    rows = [input_ids_BT[b, : lengths[b]].tolist() for b in range(input_ids_BT.shape[0])]
    clusters, alone = prefix_clusters(rows, min_prefix)
    batch, seq = input_ids_BT.shape
    order: list[int] = []
    parts: list[Tensor] = []
    for member, shared in clusters:
        index = torch.tensor(member, device=input_ids_BT.device)
        width = max(lengths[i] for i in member)
        parts.append(
            _cluster_hidden(
                decoder, input_ids_BT[index, :width], attention_mask_BT[index, :width], shared
            )
        )
        order.extend(member)
    if alone:
        index = torch.tensor(alone, device=input_ids_BT.device)
        width = max(max(lengths[i] for i in alone), 1)
        parts.append(
            decoder(
                inputs_embeds=input_embeddings(decoder, input_ids_BT[index, :width]),
                attention_mask=attention_mask_BT[index, :width],
                use_cache=False,
            ).last_hidden_state
        )
        order.extend(alone)
    padded = [torch.nn.functional.pad(p, (0, 0, 0, seq - p.shape[1])) for p in parts]
    hidden_BTH = torch.cat(padded, dim=0)
    inverse = torch.empty(batch, dtype=torch.long, device=input_ids_BT.device)
    inverse[torch.tensor(order, device=input_ids_BT.device)] = torch.arange(
        batch, device=input_ids_BT.device
    )
    return hidden_BTH[inverse]


def length_buckets(lengths: list[int], overhead: int = BUCKET_OVERHEAD) -> list[list[int]]:
    """Rows of one cluster split into suffix passes: [[row index, ...], ...].

    Each pass costs about (rows x its longest suffix) + `overhead` positions (padding included;
    `overhead` stands for a pass's fixed work); the split of the rows sorted by length into
    consecutive runs with the least total cost is found by dynamic programming (n <= a
    micro-batch, n^2 steps). Example, overhead 16: suffix lengths (30, 2, 3, 2) -> one pass
    costs 4 x 30 + 16 = 136; (2, 2, 3) and (30) cost 3 x 3 + 16 + 30 + 16 = 71: [[1, 3, 2], [0]].
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last pass holds sorted rows i..j-1; its longest is j-1's
            cost = best[i] + (j - i) * lengths[order[j - 1]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    passes: list[list[int]] = []
    j = n
    while j > 0:
        passes.append(order[cut[j] : j])
        j = cut[j]
    return passes[::-1]


def _cluster_hidden(
    decoder: Any, input_ids_BT: Tensor, attention_mask_BT: Tensor, shared: int
) -> Tensor:
    """(B_c, T_c, H) hidden states of one cluster: the prefix of `shared` tokens once, then the
    rows' suffixes on its key/value cache (positions continue at `shared`), in passes of
    rows of similar length (`length_buckets`), each on its own repeat of the cache."""
    rows, width = input_ids_BT.shape
    prefix = decoder(
        inputs_embeds=input_embeddings(decoder, input_ids_BT[:1, :shared]), use_cache=True
    )
    prefix_cache = getattr(prefix, CACHE_KEYWORD)
    lengths = [int(n) - shared for n in attention_mask_BT.bool().sum(dim=1).tolist()]
    parts: list[Tensor] = []
    order: list[int] = []
    for member in length_buckets(lengths):
        index = torch.tensor(member, device=input_ids_BT.device)
        end = shared + max(lengths[i] for i in member)
        suffix = decoder(
            inputs_embeds=input_embeddings(decoder, input_ids_BT[index, shared:end]),
            attention_mask=attention_mask_BT[index, :end],
            use_cache=True,
            **{CACHE_KEYWORD: _repeated(prefix_cache, len(member))},
        )
        hidden = suffix.last_hidden_state
        parts.append(torch.nn.functional.pad(hidden, (0, 0, 0, width - end)))
        order.extend(member)
    suffix_BSH = torch.cat(parts, dim=0)[torch.tensor(order, device=hidden.device).argsort()]
    prefix_BPH = prefix.last_hidden_state.expand(rows, -1, -1)
    return torch.cat([prefix_BPH, suffix_BSH], dim=1)


def _repeated(cache: Any, rows: int) -> Any:
    """A copy of a key/value cache with its batch of 1 repeated `rows` times; `cache` itself
    is left as it is (its layer objects are copied, their tensors replaced in the copy only),
    so the next pass can repeat it again. Layer kinds (sliding window or not) are kept."""
    repeated = copy.copy(cache)
    if hasattr(cache, "layers"):  # transformers >= 4.56
        repeated.layers = [copy.copy(layer) for layer in cache.layers]
    else:
        repeated.key_cache, repeated.value_cache = list(cache.key_cache), list(cache.value_cache)
    repeated.batch_repeat_interleave(rows)
    return repeated
