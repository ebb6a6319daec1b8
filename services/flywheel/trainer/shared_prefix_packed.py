"""The shared-prefix layout in one packed decoder pass per micro-batch.

`shared_prefix.py` runs a cluster's prompt once and then its rows' suffixes on the prompt's
key/value cache: at least two decoder passes per cluster, each computing its own weight
gradients. With the demo's short sequences (a 44-token prompt, replies of 2-32 tokens) a pass
holds a few dozen positions, so each weight-gradient product (out x positions) @ (positions x
in) is a thin one that runs far below the CPU's matmul rate, once per pass. Here a micro-batch
is one sequence instead:

    [prompt of cluster 1][suffix of row a][suffix of row b]...[prompt of cluster 2]...[row alone]

with each token's position id as in its own row (a suffix continues at P) and a 4D additive
attention mask: a token sees the earlier tokens of its own segment and, in a suffix, its
cluster's prompt. Every hidden state equals the padded pass's up to float rounding; the
decoder runs P + sum_b S_b positions per cluster with no padding, in one pass.

The mask is dense (N x N), so this layout is used for micro-batches of at most
`PACKED_MAX_TOKENS` positions and attention implementations that take a custom 4D mask
("sdpa", "eager"); others go through `shared_prefix.shared_prefix_hidden`.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import Tensor

from flywheel.trainer.grad_sinks import input_embeddings
from flywheel.trainer.shared_prefix import MIN_PREFIX, prefix_clusters, right_padded_lengths

PACKED_MAX_TOKENS = 1024
"""Largest packed sequence (positions) for the one-pass layout: its float32 mask is N^2 x 4
bytes (4 MiB at 1024) and its attention N^2 scores."""
MASK_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations that apply a custom 4D mask as given."""
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def packed_segments(
    rows: list[list[int]], min_prefix: int = MIN_PREFIX
) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
    """The one-pass layout of right-padded rows (their real tokens): (token ids, position ids,
    segment of each position, the prompt segment each position may also see (-1: none),
    source index of each row's tokens in the sequence).

    Example, min_prefix 2: rows [1,2,3], [1,2,4,5], [7] -> prompt [1,2] (segment 0, positions
    0 1), suffix [3] (segment 1, position 2), suffix [4,5] (segment 2, positions 2 3), row
    alone [7] (segment 3, position 0): ids [1,2,3,4,5,7], positions [0,1,2,2,3,0], segments
    [0,0,1,2,2,3], sees [-1,-1,0,0,0,-1], sources [[0,1,2], [0,1,3,4], [5]].
    """
    clusters, alone = prefix_clusters(rows, min_prefix)
    ids: list[int] = []
    positions: list[int] = []
    segments: list[int] = []
    sees: list[int] = []
    sources: list[list[int]] = [[] for _ in rows]

    def add(tokens: list[int], first_position: int, prompt_segment: int) -> list[int]:
        segment = segments[-1] + 1 if segments else 0
        start = len(ids)
        ids.extend(tokens)
        positions.extend(range(first_position, first_position + len(tokens)))
        segments.extend([segment] * len(tokens))
        sees.extend([prompt_segment] * len(tokens))
        return list(range(start, start + len(tokens)))

    for member, shared in clusters:
        prompt = add(rows[member[0]][:shared], 0, -1)
        prompt_segment = segments[-1]
        for b in member:
            sources[b] = prompt + add(rows[b][shared:], shared, prompt_segment)
    for b in alone:
        sources[b] = add(rows[b], 0, -1)
    return ids, positions, segments, sees, sources


def shared_prefix_packed_hidden(
    decoder: Any, input_ids_BT: Tensor, attention_mask_BT: Tensor, min_prefix: int = MIN_PREFIX
) -> tuple[Tensor, Tensor] | None:
    """(N, H) hidden states of the micro-batch's one packed pass and the (B, T) int64 index of
    each real position's hidden state in them (padded positions hold 0), or None where this
    layout does not apply (more than `PACKED_MAX_TOKENS` positions, or an attention
    implementation outside `MASK_IMPLEMENTATIONS`: use `shared_prefix_hidden`).

    Args:
        decoder: a causal LM's decoder stack (`logprobs.decoder_of`).
        input_ids_BT: (B, T) int64 token ids, right-padded.
        attention_mask_BT: (B, T) int64/bool, 1 on real tokens, right padding only.

    Raises:
        ValueError: the attention mask is not right padding.
    """
    implementation = getattr(getattr(decoder, "config", None), "_attn_implementation", None)
    if implementation not in MASK_IMPLEMENTATIONS:
        return None
    lengths = right_padded_lengths(attention_mask_BT)
    rows = [input_ids_BT[b, : lengths[b]].tolist() for b in range(input_ids_BT.shape[0])]
    ids, positions, segments, sees, sources = packed_segments(rows, min_prefix)
    if len(ids) > PACKED_MAX_TOKENS:
        return None
    device = input_ids_BT.device
    segment_N = torch.tensor(segments, device=device)
    sees_N = torch.tensor(sees, device=device)
    index_N = torch.arange(len(ids), device=device)
    visible_NN = (index_N[None, :] <= index_N[:, None]) & (
        (segment_N[None, :] == segment_N[:, None]) | (segment_N[None, :] == sees_N[:, None])
    )
    embeds_1NH = input_embeddings(decoder, torch.tensor([ids], device=device))
    if implementation == "sdpa" and TRANSFORMERS_MAJOR >= 5:  # any query dtype (autocast too)
        mask_11NN = visible_NN[None, None]
    else:  # additive, as transformers 4's 4D masks and eager attention take it
        mask_11NN = torch.zeros(visible_NN.shape, dtype=embeds_1NH.dtype, device=device)
        mask_11NN.masked_fill_(~visible_NN, torch.finfo(embeds_1NH.dtype).min)
        mask_11NN = mask_11NN[None, None]
    hidden_1NH = decoder(
        inputs_embeds=embeds_1NH,
        position_ids=torch.tensor([positions], device=device),
        attention_mask=mask_11NN,
        use_cache=False,
    ).last_hidden_state
    source_BT = torch.zeros_like(input_ids_BT)
    for b, source in enumerate(sources):
        source_BT[b, : len(source)] = torch.tensor(source, device=device)
    return hidden_1NH[0], source_BT
