"""Kernels launched from several threads at once: Triton's interpreter keeps the running program's
grid index and its patches of triton.language in globals, so interpreted launches must run one at
a time (kernels/launch.py's run_kernel); every launch goes through it."""
import ast
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import cuflash
from attn_testing import interpret

SRC = Path(cuflash.__file__).parent


def _step(i: int):
    """A rotary embedding and attention, forward and backward, on inputs of their own per i (their
    own grid sizes)."""
    g = torch.Generator().manual_seed(i)
    q, k, v = (torch.randn(1, 9 + 8 * i, 2, 16, generator=g).requires_grad_() for _ in range(3))
    angles = torch.rand(q.shape[1], 4, generator=g) * 6.28
    out = cuflash.flash_attn_func(cuflash.apply_rotary_emb(q, angles.cos(), angles.sin()), k, v, causal=i % 2 == 1)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


@interpret
@pytest.mark.interpret
def test_interpreted_launches_from_four_threads_match_one_thread(monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "triton")
    alone = [_step(i) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch every few bytecodes: a race shows on every run
    try:
        start = threading.Barrier(4)
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda i: (start.wait(), _step(i))[1], range(4)))  # raises what a thread did
        for i, (got, want) in enumerate(zip(together, alone)):
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), f"thread {i}: {name}"
    finally:
        sys.setswitchinterval(interval)


def _kernels(tree: ast.Module) -> set[str]:
    """The names a module defines with a jit decorator (@triton.jit, @gluon.jit, @triton.jit(...))."""
    def is_jit(d):
        d = d.func if isinstance(d, ast.Call) else d
        return isinstance(d, ast.Attribute) and d.attr == "jit"
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and any(map(is_jit, node.decorator_list))}


def test_every_kernel_launch_goes_through_run_kernel():
    """No module launches one of its own kernels as kernel[grid](...): run_kernel (which the plans use)
    serializes interpreted launches, and a launch elsewhere would escape it."""
    direct = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        kernels = _kernels(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in kernels):
                direct.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.value.id}")
    assert not direct
