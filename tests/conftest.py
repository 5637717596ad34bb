import os

import torch

# The CPU tests run the Triton kernels through Triton's interpreter, which must be switched on
# before the kernels are defined (when cuflash.kernels is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402 (after the interpreter switch)

# Define the kernels now, while the switch is on: tests that unset TRITON_INTERPRET (to check the
# errors without it) must not be where the kernels are first defined.
import cuflash.kernels  # noqa: E402, F401

from attn_testing import interpret  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run where torch sees a CUDA GPU and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_allocator(request):
    """In gpu tests, leaves NaN in the memory the caching allocator hands out next, so that any output
    element a kernel fails to write shows up as NaN (the checks reject non-finite values)."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.full((256 * 2**20,), float("nan"), dtype=torch.float32, device="cuda")  # freed at once
    yield


@pytest.fixture(params=["cpu", pytest.param("triton", marks=[interpret, pytest.mark.interpret])])
def backend(request, monkeypatch):
    """Runs a test on the blocked CPU path and on the Triton kernels through the interpreter."""
    monkeypatch.setenv("CUFLASH_BACKEND", request.param)
    return request.param
