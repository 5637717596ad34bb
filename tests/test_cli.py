"""The `cuflash` command on the CPU: generate, run (naive, fa1, fa2), check, info, and the errors
that exit with 2 and write nothing."""
import json

import pytest
import torch

from cuflash.cli import main
from cuflash.datafiles import read_tensor
from cuflash.reference import attention_reference


@pytest.fixture
def problem(tmp_path):
    rc = main(["generate", "--batch-size", "2", "--num-heads", "3", "--seq-len", "70", "--head-dim", "24",
               "--dtype", "float32", "--seed", "7", "--output-dir", str(tmp_path)])
    assert rc == 0
    return tmp_path / "B2_H3_S70_D24"


def test_generate_writes_raw_files_and_meta(problem):
    meta = json.loads((problem / "meta.json").read_text())
    assert meta["batch_size"] == 2 and meta["seq_len"] == 70 and meta["dtype"] == "float32" and meta["seed"] == 7
    q = read_tensor(problem / "Q.bin", (2, 3, 70, 24), torch.float32)
    assert (problem / "Q.bin").stat().st_size == 2 * 3 * 70 * 24 * 4
    assert q.std().item() == pytest.approx(1.0, abs=0.05)
    assert not torch.equal(q, read_tensor(problem / "K.bin", (2, 3, 70, 24), torch.float32))


@pytest.mark.parametrize("method", ["naive", "fa1", "fa2"])
def test_run_writes_outputs_that_match_the_oracle(problem, method, capsys):
    assert main(["run", "--compute", method, "--mode", "both", "--causal", "--data", str(problem)]) == 0
    shape = (2, 3, 70, 24)
    q, k, v = (read_tensor(problem / f"{n}.bin", shape, torch.float32).transpose(1, 2).double().requires_grad_()
               for n in "QKV")
    ref, ref_lse = attention_reference(q, k, v, causal=True)
    out = read_tensor(problem / "O.bin", shape, torch.float32)
    assert (out.double() - ref.transpose(1, 2)).abs().max() < 1e-5
    lse = read_tensor(problem / "logsumexp.bin", shape[:3], torch.float32)
    assert (lse.double() - ref_lse).abs().max() < 1e-5
    dout = read_tensor(problem / "dO.bin", shape, torch.float32)  # generated and saved
    grads = torch.autograd.grad(ref, (q, k, v), dout.transpose(1, 2).double())
    for name, g in zip(("dQ", "dK", "dV"), grads):
        assert (read_tensor(problem / f"{name}.bin", shape, torch.float32).double() - g.transpose(1, 2)).abs().max() \
            < 1e-5
    printed = capsys.readouterr().out
    assert "max abs" in printed and "MSE" in printed and " ms " in printed


def test_run_reads_an_existing_dout(problem):
    dout = torch.full((2, 3, 70, 24), 0.5)
    (problem / "dO.bin").write_bytes(dout.numpy().tobytes())
    assert main(["run", "--compute", "fa2", "--mode", "backward", "--data", str(problem)]) == 0
    assert torch.equal(read_tensor(problem / "dO.bin", (2, 3, 70, 24), torch.float32), dout)
    assert not (problem / "O.bin").exists()  # backward mode writes only the gradients


@pytest.mark.parametrize("damage,word", [
    (lambda p: (p / "K.bin").write_bytes(b"\0" * 100), "K.bin has 100 bytes"),
    (lambda p: (p / "V.bin").unlink(), "V.bin is missing"),
    (lambda p: (p / "meta.json").unlink(), "meta.json is missing"),
    (lambda p: (p / "meta.json").write_text("{not json"), "not valid metadata"),
    (lambda p: (p / "meta.json").write_text(json.dumps(dict(json.loads((p / "meta.json").read_text()), seq_len=71))),
     "Q.bin has"),
    (lambda p: (p / "meta.json").write_text(json.dumps(dict(json.loads((p / "meta.json").read_text()),
                                                            dtype="int8"))), "dtype 'int8'"),
    (lambda p: (p / "dO.bin").write_bytes(b"\0" * 8), "dO.bin has 8 bytes"),
])
def test_run_refuses_bad_folders_and_writes_nothing(problem, damage, word, capsys):
    damage(problem)
    before = {p.name: p.stat().st_mtime_ns for p in problem.iterdir()}
    assert main(["run", "--compute", "fa2", "--mode", "both", "--data", str(problem)]) == 2
    assert word in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in problem.iterdir()} == before


def test_run_unknown_method_exits_2(problem):
    with pytest.raises(SystemExit) as info:
        main(["run", "--compute", "fa3", "--data", str(problem)])
    assert info.value.code == 2


def test_run_missing_folder(tmp_path, capsys):
    assert main(["run", "--compute", "fa2", "--data", str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_check_and_info(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "max abs" in out and "sdpa" in out and "all within bounds" in out
    assert main(["info"]) == 0
    assert "backend" in capsys.readouterr().out
