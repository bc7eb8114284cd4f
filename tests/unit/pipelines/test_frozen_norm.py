"""Frozen batch norms computed over their input: the bits of torchvision's
``FrozenBatchNorm2d``, and the input kept when autograd needs it."""

from __future__ import annotations

import copy

import torch


def test_frozen_batch_norms_in_place_give_the_same_bits_and_leave_other_inputs_alone() -> None:
    from torchvision.ops.misc import FrozenBatchNorm2d

    from pipelines.models import freeze_batch_norms

    torch.manual_seed(1)
    norm = torch.nn.BatchNorm2d(8).eval()
    with torch.no_grad():
        norm.running_mean.uniform_(-1.0, 1.0)
        norm.running_var.uniform_(0.1, 3.0)
    reference = freeze_batch_norms(torch.nn.Sequential(copy.deepcopy(norm)))[0]
    in_place = freeze_batch_norms(torch.nn.Sequential(copy.deepcopy(norm)), in_place=True)[0]
    x = torch.randn(1, 8, 9, 7).to(memory_format=torch.channels_last)

    with torch.inference_mode():
        expected = reference(x.clone())
        got = in_place(x.clone())
    with torch.no_grad():
        trained = x.clone().requires_grad_(True)
    computed = in_place(trained)  # autograd on: the input is kept

    assert isinstance(in_place, FrozenBatchNorm2d)
    assert torch.equal(got, expected)
    assert torch.equal(computed.detach(), expected) and torch.equal(trained.detach(), x)


def test_a_half_precision_activation_gets_torchvisions_float32_answer_not_an_in_place_one() -> None:
    from pipelines.models import freeze_batch_norms

    torch.manual_seed(2)
    norm = torch.nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        norm.running_var.uniform_(0.1, 3.0)
    reference = freeze_batch_norms(torch.nn.Sequential(copy.deepcopy(norm)))[0]
    in_place = freeze_batch_norms(torch.nn.Sequential(copy.deepcopy(norm)), in_place=True)[0]
    x = torch.randn(1, 4, 5, 5).to(torch.bfloat16)

    with torch.inference_mode():
        expected, got = reference(x.clone()), in_place(x)

    assert got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected) and x.dtype == torch.bfloat16
