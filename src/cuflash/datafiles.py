"""Problems on disk for `cuflash generate` and `cuflash run`: a folder B{b}_H{h}_S{s}_D{d}/ holding
Q.bin, K.bin, V.bin (and dO.bin, outputs) as raw little-endian row-major (B, H, N, D) arrays,
plus meta.json with the shape, dtype and seed.

Every file derived from the inputs (dO.bin drawn from the seed, the outputs of `run`) is recorded
in meta.json's "files" with a digest of the Q, K, V it belongs to, so that nothing computed for
other inputs is ever reused; `generate` removes the derived files of the problem it replaces."""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .dtypes import ALIASES, DTYPES
from .errors import MAX_HEAD_DIM

INPUTS = ("Q", "K", "V")
# Files computed from the inputs: dO.bin (drawn from the seed unless the user wrote it) and run's outputs.
DERIVED = ("dO.bin", "O.bin", "logsumexp.bin", "dQ.bin", "dK.bin", "dV.bin")


class DataError(Exception):
    """A problem folder that cannot be used: missing or truncated files, inconsistent metadata."""


@dataclass(frozen=True)
class Meta:
    batch_size: int
    num_heads: int
    seq_len: int
    head_dim: int
    dtype: str
    seed: int
    layout: str = "BHND"
    byte_order: str = "little"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.num_heads, self.seq_len, self.head_dim)

    def nbytes(self) -> int:
        """Bytes of one (B, H, N, D) array."""
        n = DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


def folder_name(meta: Meta) -> str:
    return f"B{meta.batch_size}_H{meta.num_heads}_S{meta.seq_len}_D{meta.head_dim}"


def _to_bytes(t: torch.Tensor) -> bytes:
    data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    if sys.byteorder != "little":  # the files are little-endian on every machine
        raise DataError("big-endian hosts are not supported")
    return data


def write_tensor(path: Path, t: torch.Tensor) -> None:
    path.write_bytes(_to_bytes(t))


def read_tensor(path: Path, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    expected = dtype.itemsize
    for n in shape:
        expected *= n
    if not path.is_file():
        raise DataError(f"{path} is missing")
    size = path.stat().st_size
    if size != expected:
        raise DataError(f"{path} has {size} bytes; shape {tuple(shape)} in {str(dtype).replace('torch.', '')} "
                        f"needs {expected}")
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=dtype).view(shape)


def random_tensor(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def generate(meta: Meta, output_dir: Path) -> tuple[Path, list[str]]:
    """Writes Q, K, V (seeds seed, seed+1, seed+2) and meta.json, and removes the derived files of a
    problem this one replaces; returns the folder and the names removed."""
    folder = output_dir / folder_name(meta)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {folder}: {exc.strerror or exc}") from None
    removed = [name for name in DERIVED if (folder / name).exists()]
    for name in removed:
        (folder / name).unlink()
    for i, name in enumerate(INPUTS):
        write_tensor(folder / f"{name}.bin", random_tensor(meta.shape, DTYPES[meta.dtype], meta.seed + i))
    (folder / "meta.json").write_text(json.dumps(dict(asdict(meta), files={}), indent=2) + "\n")
    return folder, removed


def inputs_digest(inputs: dict[str, torch.Tensor]) -> str:
    """A digest of Q, K and V: what a derived file's record ties it to."""
    h = hashlib.sha256()
    for name in INPUTS:
        h.update(_to_bytes(inputs[name]))
    return h.hexdigest()[:16]


def file_records(folder: Path) -> dict:
    """meta.json's records of the derived files: {name: {"inputs": digest, ...}}."""
    return json.loads((folder / "meta.json").read_text()).get("files", {})


def record_files(folder: Path, records: dict) -> None:
    """Adds (or replaces) records of derived files in meta.json."""
    raw = json.loads((folder / "meta.json").read_text())
    raw["files"] = {**raw.get("files", {}), **records}
    (folder / "meta.json").write_text(json.dumps(raw, indent=2) + "\n")


def read_meta(folder: Path) -> Meta:
    path = folder / "meta.json"
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    if not path.is_file():
        raise DataError(f"{path} is missing (make a problem with `cuflash generate`)")
    try:
        raw = json.loads(path.read_text())
        meta = Meta(**{k: raw[k] for k in ("batch_size", "num_heads", "seq_len", "head_dim", "dtype", "seed")},
                    layout=raw.get("layout", "BHND"), byte_order=raw.get("byte_order", "little"))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{path} is not valid metadata ({type(exc).__name__}: {exc}); expected the keys "
                        f"batch_size, num_heads, seq_len, head_dim, dtype, seed") from None
    for key in ("batch_size", "num_heads", "seq_len", "head_dim"):
        value = getattr(meta, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"{path}: {key} must be a positive integer, got {value!r}")
    meta = replace(meta, dtype=ALIASES.get(meta.dtype, meta.dtype))
    if meta.dtype not in DTYPES:
        raise DataError(f"{path}: dtype {meta.dtype!r} is not one of {', '.join(DTYPES)}")
    if meta.head_dim > MAX_HEAD_DIM:
        raise DataError(f"{path}: head_dim {meta.head_dim}; supported: 1 to {MAX_HEAD_DIM}")
    if meta.layout != "BHND" or meta.byte_order != "little":
        raise DataError(f"{path}: layout {meta.layout!r} / byte order {meta.byte_order!r}; supported: BHND, little")
    return meta


def read_inputs(folder: Path, meta: Meta) -> dict[str, torch.Tensor]:
    return {name: read_tensor(folder / f"{name}.bin", meta.shape, DTYPES[meta.dtype]) for name in INPUTS}
