"""A stop abandons the step in progress in its forward or backward pass, never after."""

from __future__ import annotations

import threading

import pytest
import torch

from flywheel.trainer.abandon import abandon_on_stop
from flywheel.trainer.weights import recompute_activations

from .factories import tiny_model

IDS = torch.tensor([[1, 2, 3, 4, 5]])


def hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("recompute", [False, True])
def test_a_stop_in_the_backward_pass_abandons_the_step(recompute):
    model, stop = tiny_model(), threading.Event()
    if recompute:
        recompute_activations(model)
    optimizer = torch.optim.AdamW(model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    own_hooks = hooks(model)  # recompute_activations adds its own
    with abandon_on_stop(stop, model, optimizer) as step:
        loss = model(input_ids=IDS).logits.sum()
        stop.set()  # SIGTERM after the forward pass
        loss.backward()
        optimizer.step()  # not reached
    assert step.abandoned and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert hooks(model) == own_hooks


def test_a_stop_before_the_first_pass_abandons_it_and_no_stop_changes_nothing():
    model, stop = tiny_model(), threading.Event()
    optimizer = torch.optim.AdamW(model.parameters())
    with abandon_on_stop(stop, model, optimizer) as step:
        model(input_ids=IDS).logits.sum().backward()
    assert not step.abandoned and all(p.grad is not None for p in model.parameters())
    stop.set()
    with abandon_on_stop(stop, model, optimizer) as step:
        model(input_ids=IDS)
    assert step.abandoned and hooks(model) == 0


def test_a_stop_after_the_passes_lets_the_step_end():
    model, stop = tiny_model(), threading.Event()
    optimizer = torch.optim.AdamW(model.parameters())
    with abandon_on_stop(stop, model, optimizer) as step:
        model(input_ids=IDS).logits.sum().backward()
        stop.set()  # during optimizer.step(): too late to abandon
        optimizer.step()
    assert not step.abandoned and optimizer.state


def test_disabled_under_several_ranks():
    model, stop = tiny_model(), threading.Event()
    stop.set()
    with abandon_on_stop(stop, model, None, enabled=False) as step:
        assert hooks(model) == 0
        model(input_ids=IDS)
    assert not step.abandoned
