"""Runs flash-attn 2's own upstream test file (tests/test_flash_attn.py of Dao-AILab/flash-attention,
the v2.x line) against cuflash, on a deterministic random sample of its parametrized cases, and
reports "P passed, F failed, S skipped of N sampled (M collected)".

How it works: before pytest imports the test file, a shim package `flash_attn` is put in sys.modules
(flash_attn, flash_attn.flash_attn_interface, flash_attn.bert_padding, flash_attn.layers.rotary, any
other flash_attn.* as an empty module) whose names are cuflash's equivalents (SHIM below). A name cuflash
lacks imports as a placeholder that raises only when used, so the rest of the file still runs; the
runner lists those names before the run. Two stand-ins are the harness's, not cuflash's:
- `_get_block_size_n` (a private flash-attn helper): the key-block width of the S_dmask encoding below,
  a constant 64 that the test and the shim both read (any width both agree on decodes the same).
- S_dmask, the third value of return_attn_probs=True with dropout_p > 0: cuflash returns each
  probability exp(s - lse) (negated where dropout drops it); flash-attn 2's kernels return
  exp(s - m_j), m_j the row max over key blocks j.. (the running max of its right-to-left loop), which
  the test's normalize_flash_attn_S rescales by exp(m_j - lse). The shim re-encodes cuflash's
  probabilities that way (s = log|p| + lse, in fp32, the sign kept); --raw-probs passes them as they are.
The upstream file imports einops (rearrange, repeat): install it where it is missing. Without CUDA,
torch.cuda.get_device_capability is stubbed to (9, 0) so that the module (which reads it at import)
collects; its cases then fail (device="cuda").

Get the upstream file (not in this repository: the .probe directory is git-excluded):
    git clone https://github.com/Dao-AILab/flash-attention /tmp/fa && mkdir -p .probe/fa2 && \
        git -C /tmp/fa show v2.8.3.post1:tests/test_flash_attn.py > .probe/fa2/test_flash_attn.py
(or https://raw.githubusercontent.com/Dao-AILab/flash-attention/v2.8.3.post1/tests/test_flash_attn.py).

Usage, on a GPU machine (pytest, pytest-xdist; no flash_attn package needed), from the repository root:
    PYTHONPATH=src python scripts/fa2_suite.py --sample 400 --seed 0 -- -n 8 -q
    PYTHONPATH=src python scripts/fa2_suite.py --collect-only --sample 400 --seed 0   # counts only
Arguments after `--` go to pytest (-n 8, -x, -q, ...; a -k EXPR there filters the sample). --sample 0
runs every case (v2.8.3.post1: 508,772, 60% of them test_flash_attn_kvcache's; about a third of any
sample skips on upstream's own pytest.skip conditions). --only kvcache,varlen_output samples only the
test functions whose names contain one of those. The sample is the N cases whose sha256(seed, file
name::test id) is smallest: the same on every machine and Python, and in every xdist worker. Listing
the cases takes about 25 s, and each xdist worker spends as long again building the sample's items.
--out DIR writes junit.xml, failures.csv (node id, phase, first error line), sampled.txt, summary.json.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import functools
import hashlib
import inspect
import io
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SUITE = REPO / ".probe" / "fa2" / "test_flash_attn.py"
PLUGIN = "fa2_suite"  # this file, imported by pytest (-p) in the runner's process and in every xdist worker
UPSTREAM_TAG = "v2.8.3.post1"

# flash_attn module -> {name: "cuflash.module:attribute" or a stand-in defined below ("@name")}.
_FUNCS = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
          "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func")
SHIM: dict[str, dict[str, str]] = {
    "flash_attn": {**{f: f"@{f}" for f in _FUNCS}, "flash_attn_with_kvcache": "cuflash:flash_attn_with_kvcache",
                   "__version__": "@__version__"},
    "flash_attn.flash_attn_interface": {**{f: f"@{f}" for f in _FUNCS},
                                        "flash_attn_with_kvcache": "cuflash:flash_attn_with_kvcache",
                                        "_get_block_size_n": "@_get_block_size_n",
                                        "USE_TRITON_ROCM": "@USE_TRITON_ROCM"},
    "flash_attn.bert_padding": {n: f"cuflash.bert_padding:{n}" for n in (
        "pad_input", "unpad_input", "index_first_axis", "index_put_first_axis",
        "unpad_input_for_concatenated_sequences")},
    "flash_attn.layers": {},
    "flash_attn.layers.rotary": {n: f"cuflash.rotary:{n}" for n in (
        "apply_rotary_emb", "apply_rotary_emb_qkv_", "apply_rotary_emb_kv_", "RotaryEmbedding")},
}


# ---------------------------------------------------------------------------------------------------
# Stand-ins


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width of the S_dmask encoding that the shim's functions return (_upstream_s_dmask),
    which the test's normalize_flash_attn_S undoes with the same width: its only use. cuflash has no
    fixed width (its tiles come from a launch plan), and any width both sides agree on decodes the same
    probabilities."""
    return 64


def _upstream_s_dmask(probs, lse, head_dim, dropout, causal, cu_seqlens_q=None):
    """cuflash's return_attn_probs probabilities (B, H, Nq, Nk) (p = exp(s - lse), negated where
    dropped) in flash-attn 2's S_dmask encoding: exp(s - m_j) with m_j the max of the row's logits over
    key blocks j, j+1, ... of _get_block_size_n keys, the sign kept; fp32. lse: (B, H, Nq), or varlen
    (H, total_q) with cu_seqlens_q (probs then hold sequence b at the top left of probs[b])."""
    import torch
    with torch.no_grad():
        p = probs.float()
        batch, heads, rows, cols = p.shape
        if cu_seqlens_q is not None:
            cu = cu_seqlens_q.tolist()
            lse_rows = lse.new_full((batch, heads, rows), float("inf"), dtype=torch.float32)
            for b in range(batch):
                n = min(cu[b + 1] - cu[b], rows)
                lse_rows[b, :, :n] = lse[:, cu[b]:cu[b] + n].float()
        else:
            lse_rows = lse.float()
        mag = p.abs()
        seen = mag > 0
        s = torch.where(seen, mag.log() + lse_rows[..., None], float("-inf"))
        width = _get_block_size_n(p.device, head_dim, dropout, causal)
        block_max = torch.stack([blk.amax(dim=-1) for blk in s.split(width, dim=-1)], dim=-1)
        m = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1)
        m = m.repeat_interleave(width, dim=-1)[..., :cols]
        a = torch.where(seen, torch.exp(s - m), 0.0)
        return torch.copysign(a, p)


def _cuflash_fn(name: str, raw_probs: bool):
    """cuflash's `name`, the S_dmask it returns re-encoded as flash-attn 2's (unless raw_probs)."""
    import cuflash
    fn = getattr(cuflash, name)
    if raw_probs:
        return fn
    sig = inspect.signature(fn)
    varlen = "varlen" in name

    @functools.wraps(fn)
    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        dropout_p = a["dropout_p"]
        if a["return_attn_probs"] is not True or not (float(dropout_p) > 0):
            return result
        out, lse, probs = result
        first = next(iter(a.values()))  # q, or qkv
        cu = (a.get("cu_seqlens_q", a.get("cu_seqlens")) if varlen else None)
        return out, lse, _upstream_s_dmask(probs, lse, first.shape[-1], True, a["causal"], cu)
    return call


class _Missing:
    """A flash_attn name that cuflash lacks: importing it works, using it raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def _fail(self):
        raise NotImplementedError(f"{self._qualname}: flash-attn name with no cuflash equivalent "
                                  f"(scripts/fa2_suite.py SHIM)")

    def __call__(self, *args, **kwargs):
        self._fail()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    def __bool__(self):
        self._fail()

    def __repr__(self):
        return f"<missing {self._qualname}>"


def _resolve(target: str, raw_probs: bool):
    if target.startswith("@"):
        name = target[1:]
        if name in _FUNCS:
            return _cuflash_fn(name, raw_probs)
        if name == "__version__":
            return "2.8.3+cuflash"
        if name == "USE_TRITON_ROCM":
            return False  # (the CUDA build's value)
        return globals()[name]
    module, attr = target.split(":")
    import importlib
    return getattr(importlib.import_module(module), attr)


def provides(module: str, name: str) -> bool:
    return name in SHIM.get(module, {})


class _ShimModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _ShimFinder:
    """Makes any flash_attn.* that SHIM does not name importable as an empty shim module."""

    def __init__(self, raw_probs: bool):
        self.raw_probs = raw_probs

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "flash_attn" and not fullname.startswith("flash_attn."):
            return None
        import importlib.machinery
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _shim_module(spec.name, self.raw_probs)

    def exec_module(self, module):
        pass


def _shim_module(name: str, raw_probs: bool) -> types.ModuleType:
    mod = _ShimModule(name, f"fa2_suite shim of {name}: cuflash's equivalents")
    mod.__path__ = []  # (a package: its submodules import)
    for attr, target in SHIM.get(name, {}).items():
        setattr(mod, attr, _resolve(target, raw_probs))
    return mod


def install_shim(raw_probs: bool = False) -> None:
    """Puts the flash_attn shim in sys.modules (before any real flash_attn: this harness tests cuflash)."""
    for name in list(sys.modules):
        if name == "flash_attn" or name.startswith("flash_attn."):
            del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ShimFinder)]
    for name in sorted(SHIM, key=lambda n: n.count(".")):
        mod = _shim_module(name, raw_probs)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    sys.meta_path.insert(0, _ShimFinder(raw_probs))


def ensure_einops() -> str:
    """The upstream file imports einops's rearrange and repeat: its version, or SystemExit naming it."""
    try:
        import einops
    except ImportError:
        raise SystemExit("fa2 suite: the upstream test file needs einops (pip install einops)") from None
    return f"einops {einops.__version__}"


# ---------------------------------------------------------------------------------------------------
# The pytest plugin (this module, loaded with -p fa2_suite in the runner's process and every xdist worker)
#
# The upstream file parametrizes about half a million cases, and making a pytest item of each takes
# minutes and gigabytes in every process. So the runner first lists the cases' keys (--fa2-list: each
# function's parametrization is computed, its keys recorded and dropped before pytest makes items), picks
# the sample, and runs pytest with it (--fa2-plan): pytest_generate_tests keeps only the sampled
# parametrizations, and pytest_collection_modifyitems deselects anything else (the final word, should a
# pytest not expose metafunc._calls).


def sample_key(node) -> str:
    """A case's name independent of where the file lies: file name::test id (with its [parameters]);
    of a test function's definition, the stem its cases' keys extend."""
    return f"{node.path.name}::{node.nodeid.split('::', 1)[1]}" if "::" in node.nodeid else node.nodeid


def rank(seed: int, key: str) -> str:
    return hashlib.sha256(f"{seed}\0{key}".encode()).hexdigest()


def pick(keys, n: int, seed: int) -> list[str]:
    """The n keys of smallest rank (all with n = 0), in their given order."""
    if not n or n >= len(keys):
        return list(keys)
    chosen = set(sorted(keys, key=lambda k: rank(seed, k))[:n])
    return [k for k in keys if k in chosen]


def pytest_addoption(parser):
    group = parser.getgroup("fa2_suite", "flash-attn 2 upstream suite against cuflash (scripts/fa2_suite.py)")
    group.addoption("--fa2-only", default="", help="comma-separated substrings: only test functions named so")
    group.addoption("--fa2-list", default=None, help="write every case's key to this JSON file; run none")
    group.addoption("--fa2-plan", default=None, help="JSON file {collected, keys}: run only these cases")
    group.addoption("--fa2-state", default=None, help="directory for the runner's state files")
    group.addoption("--fa2-raw-probs", action="store_true", help="return cuflash's probabilities as S_dmask")


def pytest_configure(config):
    import torch
    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda device=None: (9, 0)  # (the module reads it at import)
    ensure_einops()
    install_shim(config.getoption("--fa2-raw-probs"))
    config._fa2_outcomes, config._fa2_messages, config._fa2_listed = {}, {}, []
    plan = config.getoption("--fa2-plan")
    config._fa2_plan = json.loads(Path(plan).read_text()) if plan else None
    config._fa2_keys = set(config._fa2_plan["keys"]) if plan else None
    _CONFIG["config"] = config


def _wanted(config, name: str) -> bool:
    only = [s for s in config.getoption("--fa2-only").split(",") if s]
    return not only or any(s in name for s in only)


@pytest.hookimpl(hookwrapper=True)
def pytest_generate_tests(metafunc):
    yield
    config = metafunc.config
    calls = getattr(metafunc, "_calls", None)
    if calls is None:
        return
    base = sample_key(metafunc.definition)
    keys = [base + (f"[{c.id}]" if c.id else "") for c in calls] or [base]
    if config.getoption("--fa2-list"):
        if _wanted(config, metafunc.function.__name__):
            config._fa2_listed.extend(keys)
        calls.clear()
    elif config._fa2_keys is not None and calls:
        calls[:] = [c for c, k in zip(calls, keys) if k in config._fa2_keys]


def pytest_collection_finish(session):
    config = session.config
    path = config.getoption("--fa2-list")
    if path:
        Path(path).write_text(json.dumps({"keys": config._fa2_listed}))


def _write_json(config, name: str, data) -> None:
    state = config.getoption("--fa2-state")
    if not state:
        return
    path = Path(state) / name
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    if config.getoption("--fa2-list"):
        return
    collected = len(items)  # (no plan: every case, the runner's --sample 0)
    if config._fa2_keys is not None:  # the runner's sample (main: pick)
        collected = config._fa2_plan["collected"]
        dropped = [it for it in items if sample_key(it) not in config._fa2_keys]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [it for it in items if sample_key(it) in config._fa2_keys]
    _write_json(config, "collection.json", {"collected": collected, "sampled": len(items),
                                            "ids": [sample_key(it) for it in items]})


_CONFIG: dict = {}


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None:
        return
    outcomes, messages = config._fa2_outcomes, config._fa2_messages
    now = outcomes.get(report.nodeid)
    if report.failed:
        outcomes[report.nodeid] = "failed"
        if now != "failed":
            text = str(report.longrepr).strip().splitlines() if report.longrepr else [""]
            err = [line for line in text if line.startswith("E ")]
            messages[report.nodeid] = (report.when, (err[0] if err else text[-1])[:300])
    elif report.skipped and now != "failed":
        outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and now is None:
        outcomes[report.nodeid] = "passed"


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput") or config.getoption("--fa2-list"):  # (xdist worker: the controller counts)
        return
    outcomes = config._fa2_outcomes
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
    failures = [[nid, *config._fa2_messages.get(nid, ("", ""))] for nid, v in outcomes.items() if v == "failed"]
    _write_json(config, "results.json", {"counts": counts, "failures": failures, "exitstatus": int(exitstatus)})


# ---------------------------------------------------------------------------------------------------
# The runner


def imported_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from flash_attn... import name` in the file (functions' too), and
    (module, "") of every `import flash_attn...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flash_attn":
            found.extend((node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((a.name, "") for a in node.names if a.name.split(".")[0] == "flash_attn")
    return found


def report_imports(path: Path) -> list[str]:
    """Prints how the file's flash_attn imports map to cuflash; returns the names cuflash lacks."""
    missing, mapped = [], {}
    for module, name in imported_names(path):
        if not name:
            if module not in SHIM:
                missing.append(f"{module} (module)")
        elif provides(module, name):
            target = SHIM[module][name]
            mapped[f"{module}.{name}"] = (f"cuflash.{target[1:]} (S_dmask re-encoded)" if target[1:] in _FUNCS
                                          else f"fa2_suite.{target[1:]} (stand-in)" if target.startswith("@")
                                          else target.replace(":", "."))
        elif f"{module}.{name}" in SHIM:
            mapped[f"{module}.{name}"] = "(shim submodule)"
        else:
            missing.append(f"{module}.{name}")
    print(f"fa2 suite: {_shown(path)}: {len(mapped)} flash_attn names mapped to cuflash:")
    for name, target in sorted(mapped.items()):
        print(f"    {name} -> {target}")
    if missing:
        print(f"fa2 suite: missing in cuflash (placeholders that raise when used): {', '.join(sorted(set(missing)))}")
    return sorted(set(missing))


def _shown(path: Path) -> str:
    """path relative to the repository where it lies inside (results name no machine's paths)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 epilog="Arguments after -- go to pytest.")
    ap.add_argument("--suite", type=Path, default=DEFAULT_SUITE, help="the upstream test file (default %(default)s)")
    ap.add_argument("--sample", type=int, default=400, help="cases to run (default %(default)s), picked by --seed; "
                    "0: all")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default %(default)s)")
    ap.add_argument("--only", default="", help="comma-separated substrings: sample only the test functions whose "
                    "names contain one (e.g. kvcache,varlen_output); pytest's -k after -- filters the sample instead")
    ap.add_argument("--out", type=Path, default=None, help="directory for junit.xml, failures.csv, sampled.txt, "
                    "summary.json")
    ap.add_argument("--collect-only", action="store_true", help="count the cases and the sample; run nothing")
    ap.add_argument("--raw-probs", action="store_true", help="return cuflash's return_attn_probs probabilities "
                    "as S_dmask, not re-encoded (the dropout cases' attention check then fails)")
    args = ap.parse_args(argv)
    if args.sample < 0:
        ap.error("--sample must be >= 0")
    suite = args.suite.resolve()
    if not suite.is_file():
        print(f"fa2 suite: no upstream test file at {suite}; see this script's docstring to get it "
              f"(flash-attention {UPSTREAM_TAG}, tests/test_flash_attn.py)", file=sys.stderr)
        return 2

    # This module is pytest's plugin in this process and in xdist's workers, which take this process's
    # sys.path (as xdist finds it when it loads) and environment.
    here, src = str(Path(__file__).resolve().parent), str(REPO / "src")
    for path in (src, here):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, src, *filter(None, [os.environ.get("PYTHONPATH")])])

    print(f"fa2 suite: {ensure_einops()}")
    import torch
    if not torch.cuda.is_available():
        print("fa2 suite: no CUDA here: torch.cuda.get_device_capability is stubbed to (9, 0) so that the file "
              "collects; its cases fail (device='cuda') or skip")
    missing = report_imports(suite)
    base = [str(suite), "-p", PLUGIN, "--rootdir", str(suite.parent), "-p", "no:cacheprovider"]
    if args.raw_probs:
        base.append("--fa2-raw-probs")
    if args.only:
        base.append(f"--fa2-only={args.only}")
    with tempfile.TemporaryDirectory(prefix="fa2_suite_") as tmp:
        state = Path(tmp)
        base.append(f"--fa2-state={state}")
        if args.sample or args.only:  # (list the cases, pick the sample, make items of it alone)
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                code = pytest.main(base + [f"--fa2-list={state / 'all.json'}", "--collect-only", "-qq"])
            listed = _read(state / "all.json")
            if listed is None:
                print(log.getvalue())
                print(f"fa2 suite: listing the cases failed (pytest exit {int(code)})", file=sys.stderr)
                return int(code) or 1
            keys = listed["keys"]
            (state / "plan.json").write_text(json.dumps({"collected": len(keys),
                                                         "keys": pick(keys, args.sample, args.seed)}))
            base.append(f"--fa2-plan={state / 'plan.json'}")
        pargs = base + (["--collect-only", "-qq"] if args.collect_only else [])
        if args.out and not args.collect_only:
            args.out.mkdir(parents=True, exist_ok=True)
            pargs.append(f"--junitxml={args.out / 'junit.xml'}")
        code = pytest.main(pargs + extra)
        coll, res = _read(state / "collection.json"), _read(state / "results.json")
    collected, sampled = (coll or {}).get("collected", 0), (coll or {}).get("sampled", 0)
    if args.out and coll:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sampled.txt").write_text("".join(f"{i}\n" for i in coll["ids"]))
    if args.collect_only:
        print(f"fa2 suite: {collected} cases collected, the sample keeps {sampled} (seed {args.seed})")
        return int(code)
    counts = (res or {}).get("counts", {"passed": 0, "failed": 0, "skipped": 0})
    if args.out:
        with open(args.out / "failures.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["nodeid", "phase", "message"])
            w.writerows((res or {}).get("failures", []))
        (args.out / "summary.json").write_text(json.dumps({
            "suite": _shown(suite), "seed": args.seed, "sample": args.sample, "only": args.only,
            "collected": collected, "sampled": sampled, **counts, "missing_names": missing,
            "pytest_args": extra, "raw_probs": args.raw_probs, "exitstatus": int(code)}, indent=1))
    if missing:
        print(f"fa2 suite: names cuflash lacks (their cases fail): {', '.join(missing)}")
    print(f"fa2 suite: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"of {sampled} sampled ({collected} collected), seed {args.seed}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
