"""Shapes at the edges, through the public functions and autograd, on every backend that runs here."""
import pytest
import torch
import torch.nn.functional as F

import normkit
from conftest import DEVICE
from helpers import randn

BACKENDS = ["torch", "triton"] + (["cuda"] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_of_an_empty_batch(backend, channels_last):
    x = torch.empty(0, 8, 3, 3, device=DEVICE)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    w = randn(8, device=DEVICE).requires_grad_()
    y = normkit.group_norm(x, 4, w, None, backend=backend)
    assert y.shape == F.group_norm(x.detach(), 4).shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_row_norm_of_an_empty_batch(backend, op):
    x = torch.empty(0, 5, 16, device=DEVICE, requires_grad=True)
    w = randn(16, device=DEVICE).requires_grad_()
    y = getattr(normkit, op)(x, 16, w, backend=backend)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
