"""Packaging: `python -m build` makes a wheel that installs and runs in a fresh virtual environment
(with the pinned torch), carrying py.typed and every subpackage, and an sdist that carries the
tests, the documents and the metadata."""
import email.parser
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("build")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_runs_in_a_fresh_venv(tmp_path):
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("cuflash_attn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for member in ("cuflash/py.typed", "cuflash/kernels/triton/forward.py", "cuflash/kernels/gluon/forward.py",
                   "cuflash/methods/fa1.py",
                   "cuflash/integrations/transformers.py", "cuflash/bench/harness.py"):
        assert member in names, member
    venv = tmp_path / "venv"
    # The fresh environment must not see this source tree (a PYTHONPATH=src makes pip skip the wheel).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    subprocess.run(pip + [torch_pin], check=True, capture_output=True, env=env)
    subprocess.run(pip + [str(wheel)], check=True, capture_output=True, env=env)
    script = ("import torch, cuflash; q = torch.randn(1, 40, 2, 16); "
              "out = cuflash.flash_attn_func(q, q, q, causal=True); print(out.shape, cuflash.__file__)")
    result = subprocess.run([str(venv / "bin" / "python"), "-c", script], check=False, capture_output=True, text=True,
                            cwd=tmp_path, env=env)
    assert "torch.Size([1, 40, 2, 16])" in result.stdout and str(venv) in result.stdout, result.stderr[-2000:]
    info = subprocess.run([str(venv / "bin" / "cuflash"), "info"], check=True, capture_output=True, text=True, env=env)
    assert "backend" in info.stdout


@pytest.mark.slow
def test_sdist_carries_the_tests_their_helpers_the_docs_and_the_metadata(tmp_path):
    """The sdist runs its own tests (their helpers, and the example and scripts that some run), holds
    every file the README and the documents it links to link to, and its metadata names the authors,
    the license and the classifiers."""
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (sdist,) = tmp_path.glob("cuflash_attn-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        info = email.parser.Parser().parsestr(tar.extractfile(f"{sdist.name[:-7]}/PKG-INFO").read().decode())
    wanted = {"tests/conftest.py", "tests/attn_testing.py", "examples/train_llama_cp.py", "scripts/cp_bench.py",
              "scripts/compile_check.py", "scripts/ab.py", "BENCHMARKS.md"}
    wanted |= {str(path.relative_to(ROOT)) for path in ROOT.glob("tests/test_*.py")}
    documents = ["README.md"]
    for document in documents:  # the README, and every document it links to, grows as links are found
        for target in re.findall(r"\]\(([^)#\s]+)", (ROOT / document).read_text()):
            if "://" not in target:  # a relative link, from the document's own folder
                path = os.path.relpath(os.path.normpath(ROOT / os.path.dirname(document) / target), ROOT)
                wanted.add(path)
                if path.endswith(".md") and path not in documents:
                    documents.append(path)
    wanted |= {str(path.relative_to(ROOT)) for path in ROOT.glob("docs/*.md")}
    assert not sorted(wanted - names)
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    assert info["Author"] == "cuflash developers" and info["License-Expression"] == "MIT"
    classifiers = info.get_all("Classifier") or []
    for wanted_classifier in ("Programming Language :: Python :: 3.10", "Operating System :: POSIX :: Linux",
                              "Topic :: Scientific/Engineering :: Artificial Intelligence", "Typing :: Typed"):
        assert wanted_classifier in classifiers
