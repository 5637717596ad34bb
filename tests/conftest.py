import os

import torch

# The CPU tests run the Triton kernels through Triton's interpreter, which must be switched on
# before the kernels are defined (when cuflash.kernels is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402 (after the interpreter switch)

from attn_testing import interpret  # noqa: E402


@pytest.fixture(params=["cpu", pytest.param("triton", marks=[interpret, pytest.mark.interpret])])
def backend(request, monkeypatch):
    """Runs a test on the blocked CPU path and on the Triton kernels through the interpreter."""
    monkeypatch.setenv("CUFLASH_BACKEND", request.param)
    return request.param
