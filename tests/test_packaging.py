"""Packaging: `python -m build` makes a wheel that installs and runs in a fresh virtual environment
(with the pinned torch), carrying py.typed and every subpackage."""
import os
import subprocess
import sys
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
