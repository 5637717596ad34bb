import os
import random

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
    """Tests marked gpu run where torch sees a CUDA GPU and are skipped elsewhere. With
    CUFLASH_TEST_SHUFFLE=<seed> the tests run in an order shuffled by that seed (the same in every
    xdist worker), to find tests that depend on what others leave behind."""
    seed = os.environ.get("CUFLASH_TEST_SHUFFLE")
    if seed:
        random.Random(seed).shuffle(items)
    if torch.cuda.is_available():
        for item in items:
            group = kernel_group(item)
            if group:
                item.add_marker(pytest.mark.xdist_group(group))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What a gpu test's process may keep reserved in torch's caching allocator after the test: the
# suite's workers share one GPU, and one worker holding what its largest test needed starves the others.
KEPT_GPU_MEMORY = 2 * 2**30


def kernel_group(item) -> str | None:
    """The xdist group (pytest -n N --dist loadgroup) of a gpu test parametrized by dtype and head
    dim: its function, dtype and head dim. Such tests compile the same kernels, and on an empty Triton
    cache workers that start them at once each compile them."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "gpu" not in item.keywords or "dtype" not in params or "head_dim" not in params:
        return None
    return f"{item.originalname}-{params['dtype']}-{params['head_dim']}"


@pytest.fixture(autouse=True)
def poison_allocator(request):
    """In gpu tests, leaves NaN in the memory the caching allocator hands out next, so that any output
    element a kernel fails to write shows up as NaN (the checks reject non-finite values); afterwards
    gives what the test reserved beyond KEPT_GPU_MEMORY back to the GPU."""
    gpu = "gpu" in request.keywords and torch.cuda.is_available()
    if gpu:
        torch.full((256 * 2**20,), float("nan"), dtype=torch.float32, device="cuda")  # freed at once
    yield
    if gpu and torch.cuda.memory_reserved() > KEPT_GPU_MEMORY:
        torch.cuda.empty_cache()


@pytest.fixture(params=["cpu", pytest.param("triton", marks=[interpret, pytest.mark.interpret])])
def backend(request, monkeypatch):
    """Runs a test on the blocked CPU path and on the Triton kernels through the interpreter."""
    monkeypatch.setenv("CUFLASH_BACKEND", request.param)
    return request.param
