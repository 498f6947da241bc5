"""Test set-up shared by every test file.

Without a CUDA GPU the Triton kernels run under the Triton interpreter, which must be switched on
before triton is first imported; with a GPU the same tests run compiled, on CUDA tensors.
Tests marked `gpu` are skipped, and only they, when no GPU is present.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poison(monkeypatch):
    """Fill every buffer the Triton kernels must write with NaN, so an unwritten element shows."""
    import normkit.backends.triton as tb

    def nan_empty(*shape, dtype=None, device=None, **kw):
        return torch.empty(*shape, dtype=dtype, device=device, **kw).fill_(float("nan"))

    def nan_empty_like(t, **kw):
        return torch.empty_like(t, **kw).fill_(float("nan"))

    monkeypatch.setattr(tb, "_empty", nan_empty)
    monkeypatch.setattr(tb, "_empty_like", nan_empty_like)
    from normkit import _host
    monkeypatch.setattr(_host, "fast", None)  # replayed launch plans allocate their own (unpoisoned) buffers


@pytest.fixture
def exact_fp32():
    """No TF32 on a GPU (its 2**-11 rounding would swamp the fp32 differences a test measures);
    use with pytestmark = pytest.mark.usefixtures("exact_fp32")."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def host_path_calls(monkeypatch):
    """The C++ host path replaced by one that declines every call (the Python path then runs) and
    keeps the positional arguments of each row_norm call it got: a list, the fixture's value."""
    from normkit import _host

    calls = []

    class Decline:
        def row_norm(self, *a, **k):
            assert not k, "the host path takes positional arguments only"
            calls.append(a)

        def group_norm(self, *a, **k):
            return None

    monkeypatch.setattr(_host, "fast", Decline())
    return calls
