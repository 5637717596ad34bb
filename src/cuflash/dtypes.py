"""Dtype names on the command line and in problem files: one short name each (fp16, bf16, fp32),
torch's long names accepted as well; and the dtype of softmax_lse and of the accumulators (lse_dtype)."""
from __future__ import annotations

import argparse

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}


def dtype_name(name: str) -> str:
    """The short name of a dtype given by either name; an argparse type (bad names exit 2)."""
    short = ALIASES.get(name, name)
    if short not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; accepted: {', '.join(DTYPES)} "
                                         f"(or {', '.join(ALIASES)})")
    return short


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax_lse and of every accumulator outside the kernels: float32, except for
    float64 inputs (CPU path), which keep float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32
