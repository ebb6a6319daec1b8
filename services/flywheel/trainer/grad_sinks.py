"""Gradients of the (V, H) vocabulary matrices added straight into `.grad`.

SmolLM2's tied embedding is a 49152 x 576 fp32 matrix (113 MB). Autograd would give it, per
micro-batch, two dense (V, H) gradient temporaries: the lm head's (`logprobs.TemperedHeadLogprob`)
and the input embedding's (`torch.embedding`'s backward zero-fills a (V, H) tensor and scatters
the few hundred rows a micro-batch touched into it), then add both into `.grad`. On a CPU each
temporary costs a 113 MB allocation, its page faults and a pass over it: about 0.25 s per
micro-batch for the embedding's alone on the demo's shapes (torch.profiler, 1 thread). Here the
head's `addmm_` and the embedding's `index_add_` go into `.grad` in place, which
`ensure_grad_sinks` creates once per step: the same sum, without the temporaries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx


def adds_into_grad(weight: Tensor) -> bool:
    """Whether a weight's gradient may be added straight into `weight.grad` (returning None to
    autograd) instead of being returned as a new tensor: a plain fp32 leaf whose `.grad`
    already exists (`ensure_grad_sinks`) and that has no hooks. FSDP2's DTensor parameters,
    bf16 weights and hooked parameters keep autograd's own accumulation."""
    grad = weight.grad if weight.is_leaf else None
    return (
        type(grad) is torch.Tensor
        and grad.dtype == torch.float32
        and grad.is_contiguous()
        and _plain_fp32(weight)
    )


def _plain_fp32(weight: Tensor) -> bool:
    """A plain (not DTensor) fp32 tensor without gradient hooks."""
    return (
        type(weight.data) is torch.Tensor
        and weight.dtype == torch.float32
        and not weight._backward_hooks
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
    )


def _sink_eligible(weight: Tensor) -> bool:
    return (
        isinstance(weight, nn.Parameter)
        and weight.requires_grad
        and weight.grad is None
        and _plain_fp32(weight)
    )


def ensure_grad_sinks(model: Any) -> None:
    """Give the model's input and output embedding weights a zero `.grad` where they have none
    (after `zero_grad(set_to_none=True)`), so every micro-batch of the step, the first one too,
    adds their gradients in place. Models without embedding accessors are left alone."""
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "weight", None)
        if weight is not None and _sink_eligible(weight):
            weight.grad = torch.zeros_like(weight)


class EmbeddingIntoGrad(torch.autograd.Function):
    """x_bt = W[id_bt]; backward adds dL/dx_bt into row id_bt of `W.grad` (`index_add_`), or
    returns the dense (V, H) gradient where `adds_into_grad(W)` is False. Rows of
    `padding_idx` get no gradient, as in `nn.Embedding`."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, ids: Tensor, weight_VH: Tensor, padding_idx: int | None
    ) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_param = weight_VH  # type: ignore[attr-defined]
        ctx.padding_idx = padding_idx  # type: ignore[attr-defined]
        return nn.functional.embedding(ids, weight_VH)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[None, Tensor | None, None]:
        if not ctx.needs_input_grad[1]:
            return None, None, None
        (ids,) = ctx.saved_tensors
        weight = ctx.weight_param
        flat_ids = ids.reshape(-1)
        flat_grad = grad_out.reshape(-1, weight.shape[1]).to(weight.dtype)
        if ctx.padding_idx is not None:
            flat_grad = flat_grad.masked_fill((flat_ids == ctx.padding_idx)[:, None], 0.0)
        if adds_into_grad(weight):
            weight.grad.index_add_(0, flat_ids, flat_grad)
            return None, None, None
        return None, torch.zeros_like(weight).index_add_(0, flat_ids, flat_grad), None


def input_embeddings(decoder: Any, input_ids: Tensor) -> Tensor:
    """(..., H) input embeddings of `input_ids` (...,) for `decoder(inputs_embeds=...)`: through
    `EmbeddingIntoGrad` for a plain `nn.Embedding` (no max_norm, not sparse), else through the
    decoder's own embedding module (scaled embeddings, sharded or adapter-wrapped ones)."""
    module = decoder.get_input_embeddings()
    if type(module) is nn.Embedding and module.max_norm is None and not module.sparse:
        return EmbeddingIntoGrad.apply(input_ids, module.weight, module.padding_idx)
    return module(input_ids)
