"""Problems on disk for `cuflash generate` and `cuflash run`: a folder B{b}_H{h}_S{s}_D{d}/ holding
Q.bin, K.bin, V.bin (and dO.bin, outputs) as raw little-endian row-major (B, H, N, D) arrays,
plus meta.json with the shape, dtype and seed.

Every file derived from the inputs (dO.bin drawn from the seed, the outputs of `run`) is recorded
in meta.json's "files" with a digest of the Q, K, V it belongs to, so that nothing computed for
other inputs is ever reused; `generate` removes the derived files of the problem it replaces.

Files are replaced whole (replace_files): each is written under a temporary name beside it and
renamed into place, meta.json last, with Ctrl-C held back while the renames run; an error or an
interrupt before them leaves the folder as it was."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .dtypes import ALIASES, DTYPES
from .validate import MAX_HEAD_DIM

INPUTS = ("Q", "K", "V")
# Files computed from the inputs: dO.bin (drawn from the seed unless the user wrote it) and run's outputs.
DERIVED = ("dO.bin", "O.bin", "logsumexp.bin", "dQ.bin", "dK.bin", "dV.bin")
# Seeds torch's generators take, with room for the last one drawn from them (dO.bin's: seed + 3).
SEEDS = (-2**63, 2**64 - 1 - len(INPUTS))
SHAPE_KEYS = ("batch_size", "num_heads", "seq_len", "head_dim")


class DataError(ValueError):
    """A problem folder that cannot be used: missing or truncated files, inconsistent metadata, no
    room to write."""


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

    def numel(self) -> int:
        """Elements of one (B, H, N, D) array."""
        return self.batch_size * self.num_heads * self.seq_len * self.head_dim

    def nbytes(self) -> int:
        """Bytes of one (B, H, N, D) array."""
        return self.numel() * DTYPES[self.dtype].itemsize


def folder_name(meta: Meta) -> str:
    return f"B{meta.batch_size}_H{meta.num_heads}_S{meta.seq_len}_D{meta.head_dim}"


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as they go to disk (a view of them where the tensor is contiguous on the CPU)."""
    if sys.byteorder != "little":  # the files are little-endian on every machine
        raise DataError("big-endian hosts are not supported")
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data


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


def available_memory() -> int | None:
    """Bytes of memory a new allocation can have: Linux's MemAvailable, less where a cgroup (v2)
    limit leaves less; None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def check_memory(nbytes: int, what: str) -> None:
    """Raises DataError when `what` needs more than the memory available."""
    available = available_memory()
    if available is not None and nbytes > available:
        raise DataError(f"{what} takes {gigabytes(nbytes)} of memory; {gigabytes(available)} is available")


def check_room(folder: Path, sizes: dict[str, int]) -> None:
    """Raises DataError unless files of these sizes can be written into `folder` (made where it does
    not exist): the folder, or the one it would be made in, takes new files; no folder or other
    non-file sits where one of them goes; the disk has room for all of them (their temporary copies
    sit beside the files they replace until the renames)."""
    existing = folder
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        raise DataError(f"cannot create {folder}: {existing} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise DataError(f"cannot write in {existing}: {exc.strerror or exc}") from None
    for name in sizes:
        path = folder / name
        if os.path.lexists(path) and not path.is_file():
            raise DataError(f"{path} is in the way: not a file, and {name} is written there")
    free, need = shutil.disk_usage(existing).free, sum(sizes.values())
    if need > free:
        raise DataError(f"{', '.join(sizes)} take {gigabytes(need)} on disk; {gigabytes(free)} is free at {existing}")


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) back while the block runs and delivers it after: what the block renames
    lands whole. (Only the main thread can set the handler; elsewhere the block runs as it is.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)
    elif caught and previous != signal.SIG_IGN:
        raise KeyboardInterrupt


def _stage(folder: Path, name: str, data) -> Path:
    """Writes `data` (bytes-like) to a new hidden file in `folder` named after `name`, on disk before it
    returns; the file gets the permissions of any new file. Returns its path."""
    path = folder / f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _write_meta(folder: Path, text: str) -> None:
    staged = _stage(folder, "meta.json", text.encode())
    try:
        os.replace(staged, folder / "meta.json")
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def replace_files(folder: Path, files: Iterable[tuple[str, torch.Tensor]], meta: Callable[[list[str]], str | None],
                  remove: Iterable[str] = ()) -> list[str]:
    """Writes each (name, tensor) of `files` (drawn one at a time) under a temporary name in `folder`;
    then, with Ctrl-C held back: removes the files named in `remove`, renames each written file into
    place and writes meta.json with the text meta(names renamed) (not at all for None). An error or
    interrupt while writing leaves the folder as it was; a rename that fails leaves the ones before it
    in place and meta.json saying so. Returns the names renamed."""
    staged: dict[str, Path] = {}
    done: list[str] = []
    try:
        for name, tensor in files:
            staged[name] = _stage(folder, name, tensor_bytes(tensor))
            del tensor  # (the next one is drawn without this one in memory)
        with held_interrupts():
            for name in remove:
                (folder / name).unlink(missing_ok=True)
            try:
                for name, path in staged.items():
                    os.replace(path, folder / name)
                    done.append(name)
            finally:
                text = meta(done)
                if text is not None:
                    _write_meta(folder, text)
    finally:
        for name, path in staged.items():
            if name not in done:
                path.unlink(missing_ok=True)
    return done


def _make_folder(folder: Path) -> list[Path]:
    """Makes `folder` and the folders above it that are missing; returns those made, deepest first."""
    made = []
    path = folder
    while not os.path.lexists(path):
        made.append(path)
        path = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {folder}: {exc.strerror or exc}") from None
    return made


def generate(meta: Meta, output_dir: Path) -> tuple[Path, list[str]]:
    """Writes Q, K, V (seeds seed, seed+1, seed+2) and meta.json, and removes the derived files of a
    problem this one replaces; returns the folder and the names removed. Memory and disk are checked
    before anything is made; until the new files are renamed into place the old problem stays whole,
    and a folder made for the problem is removed again when it does not come about."""
    folder = output_dir / folder_name(meta)
    dtype = DTYPES[meta.dtype]
    drawn = meta.numel() * (4 + (dtype.itemsize if dtype != torch.float32 else 0))  # fp32 draw, then cast
    check_memory(drawn, f"drawing one {meta.shape} {meta.dtype} array")
    check_room(folder, {f"{name}.bin": meta.nbytes() for name in INPUTS} | {"meta.json": 0})
    made = _make_folder(folder)
    try:
        removed = [name for name in DERIVED if (folder / name).exists()]
        tensors = ((f"{name}.bin", random_tensor(meta.shape, dtype, meta.seed + i)) for i, name in enumerate(INPUTS))
        text = json.dumps(dict(asdict(meta), files={}), indent=2) + "\n"
        # meta.json goes first and comes back last: a problem cut short by a failed rename has none
        replace_files(folder, tensors, lambda done: text if len(done) == len(INPUTS) else None,
                      remove=["meta.json", *removed])
    except BaseException:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    return folder, removed


def inputs_digest(inputs: dict[str, torch.Tensor]) -> str:
    """A digest of Q, K and V: what a derived file's record ties it to."""
    h = hashlib.sha256()
    for name in INPUTS:
        h.update(tensor_bytes(inputs[name]))
    return h.hexdigest()[:16]


def _load(path: Path) -> dict:
    """meta.json's object; DataError where it is not UTF-8 JSON holding an object."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not valid metadata: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid metadata (JSON: {exc})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path} is not valid metadata: a JSON {type(raw).__name__}, where an object with the "
                        f"keys {', '.join(SHAPE_KEYS)}, dtype, seed goes")
    return raw


def _records(path: Path, raw: dict) -> dict:
    files = raw.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(record, dict) for record in files.values()):
        raise DataError(f"{path}: files must map file names to records ({{\"dO.bin\": {{\"inputs\": ...}}}}), "
                        f"got {json.dumps(files)[:60]}")
    return files


def file_records(folder: Path) -> dict:
    """meta.json's records of the derived files: {name: {"inputs": digest, ...}}."""
    path = folder / "meta.json"
    return _records(path, _load(path))


def write_outputs(folder: Path, files: list[tuple[str, torch.Tensor]], records: dict[str, dict]) -> list[str]:
    """Writes run's files with replace_files; meta.json then records those renamed into place (the
    record of each from `records`). Returns their names."""
    def meta(done: list[str]) -> str | None:
        if not done:
            return None
        raw = _load(folder / "meta.json")
        raw["files"] = {**_records(folder / "meta.json", raw), **{name: records[name] for name in done}}
        return json.dumps(raw, indent=2) + "\n"
    return replace_files(folder, files, meta)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_meta(folder: Path) -> Meta:
    """The problem's metadata, every field checked (and the file records' form)."""
    path = folder / "meta.json"
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    if not path.is_file():
        raise DataError(f"{path} is missing (make a problem with `cuflash generate`)")
    raw = _load(path)
    missing = [key for key in (*SHAPE_KEYS, "dtype", "seed") if key not in raw]
    if missing:
        raise DataError(f"{path} is not valid metadata: no {', '.join(missing)}; expected the keys "
                        f"{', '.join(SHAPE_KEYS)}, dtype, seed")
    for key in SHAPE_KEYS:
        if not _is_int(raw[key]) or raw[key] < 1:
            raise DataError(f"{path}: {key} must be a positive integer, got {raw[key]!r}")
    if not _is_int(raw["seed"]) or not SEEDS[0] <= raw["seed"] <= SEEDS[1]:
        raise DataError(f"{path}: seed must be an integer from {SEEDS[0]} to {SEEDS[1]}, got {raw['seed']!r}")
    dtype = raw["dtype"]
    if not isinstance(dtype, str) or ALIASES.get(dtype, dtype) not in DTYPES:
        raise DataError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if raw["head_dim"] > MAX_HEAD_DIM:
        raise DataError(f"{path}: head_dim {raw['head_dim']}; supported: 1 to {MAX_HEAD_DIM}")
    layout, byte_order = raw.get("layout", "BHND"), raw.get("byte_order", "little")
    if layout != "BHND" or byte_order != "little":
        raise DataError(f"{path}: layout {layout!r} / byte order {byte_order!r}; supported: BHND, little")
    _records(path, raw)
    return Meta(raw["batch_size"], raw["num_heads"], raw["seq_len"], raw["head_dim"], ALIASES.get(dtype, dtype),
                raw["seed"])


def read_inputs(folder: Path, meta: Meta) -> dict[str, torch.Tensor]:
    return {name: read_tensor(folder / f"{name}.bin", meta.shape, DTYPES[meta.dtype]) for name in INPUTS}
