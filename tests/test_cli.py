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
    # --dtype float32 is accepted and named as everywhere else: fp32
    assert meta["batch_size"] == 2 and meta["seq_len"] == 70 and meta["dtype"] == "fp32" and meta["seed"] == 7
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


def test_run_unknown_method_exits_2(problem, capsys):
    assert main(["run", "--compute", "fa3", "--data", str(problem)]) == 2
    assert "argument --compute: invalid choice: 'fa3'" in capsys.readouterr().err


def test_run_missing_folder(tmp_path, capsys):
    assert main(["run", "--compute", "fa2", "--data", str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_check_and_info(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "max abs" in out and "sdpa" in out and "10 of 10 cases within the bounds" in out
    assert main(["info"]) == 0
    assert "backend" in capsys.readouterr().out


def _one_line_exit_2(argv, capsys, word):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in captured.err, captured.err


def test_bad_generate_and_run_arguments_exit_2_with_one_line(tmp_path, problem, capsys, monkeypatch):
    _one_line_exit_2(["generate", "--head-dim", "600", "--output-dir", str(tmp_path / "a")], capsys, "--head-dim")
    _one_line_exit_2(["generate", "--seq-len", "0", "--output-dir", str(tmp_path / "a")], capsys, "--seq-len")
    assert not (tmp_path / "a").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    _one_line_exit_2(["generate", "--output-dir", str(blocker / "sub")], capsys, "cannot create")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = sorted(p.name for p in problem.iterdir())
    _one_line_exit_2(["run", "--compute", "fa2", "--device", "cuda", "--data", str(problem)], capsys, "--device cuda")
    _one_line_exit_2(["run", "--compute", "naive", "--block-m", "32", "--block-n", "32", "--data", str(problem)],
                     capsys, "block_m")
    _one_line_exit_2(["run", "--compute", "fa2", "--block-m", "24", "--block-n", "32", "--data", str(problem)],
                     capsys, "block_m")
    meta = json.loads((problem / "meta.json").read_text())
    (problem / "meta.json").write_text(json.dumps(dict(meta, head_dim=600)))
    _one_line_exit_2(["run", "--compute", "fa2", "--data", str(problem)], capsys, "head_dim")
    assert sorted(p.name for p in problem.iterdir()) == before


def test_regenerating_replaces_the_derived_files(tmp_path, capsys):
    """A problem generated again (another seed) into the same folder drops the old dO.bin and
    outputs; run then draws dO from the new seed instead of reusing one drawn for other inputs."""
    args = ["generate", "--batch-size", "1", "--num-heads", "2", "--seq-len", "20", "--head-dim", "16",
            "--output-dir", str(tmp_path)]
    folder = tmp_path / "B1_H2_S20_D16"
    assert main(args + ["--seed", "1"]) == 0
    assert main(["run", "--compute", "fa2", "--mode", "both", "--data", str(folder)]) == 0
    old_dout = read_tensor(folder / "dO.bin", (1, 2, 20, 16), torch.float32)
    assert main(args + ["--seed", "2"]) == 0
    assert "removed the replaced problem's dO.bin, O.bin" in capsys.readouterr().out
    assert not (folder / "dO.bin").exists() and not (folder / "dQ.bin").exists()
    assert main(["run", "--compute", "fa2", "--mode", "both", "--data", str(folder)]) == 0
    assert not torch.equal(read_tensor(folder / "dO.bin", (1, 2, 20, 16), torch.float32), old_dout)
    # inputs changed behind the record's back: the recorded dO.bin no longer matches and is drawn again
    (folder / "Q.bin").write_bytes(torch.randn(1, 2, 20, 16).numpy().tobytes())
    capsys.readouterr()
    assert main(["run", "--compute", "fa2", "--mode", "backward", "--data", str(folder)]) == 0
    assert "drawn for other inputs" in capsys.readouterr().out
    records = json.loads((folder / "meta.json").read_text())["files"]
    assert records["dQ.bin"]["inputs"] == records["dO.bin"]["inputs"]


def test_non_finite_inputs_warn_and_check_fails_on_them(problem, capsys, monkeypatch):
    (problem / "Q.bin").write_bytes(torch.full((2, 3, 70, 24), float("nan")).numpy().tobytes())
    assert main(["run", "--compute", "fa2", "--data", str(problem)]) == 0
    err = capsys.readouterr().err
    assert "Q.bin holds 10080 non-finite values" in err and "outputs hold non-finite" in err
    import cuflash.interface
    monkeypatch.setattr(cuflash.interface, "flash_attn_func", lambda q, *a, **kw: torch.full_like(q, float("nan")))
    assert main(["check"]) == 1
    assert "non-finite values in the output" in capsys.readouterr().out


def test_check_tolerance_and_stop_on_failure(capsys):
    # fp32 cannot reach 1e-12 but on the two one-token cases (exact): the third case stops the run
    assert main(["check", "--tolerance", "1e-12"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAILED") == 1 and "stopped at the first failure (3 cases run" in out
    # the number judged (||err||/||ref||) is in the table beside its bound, as the failure quotes it
    judged = out.split("^ FAILED: ||err||/||ref|| = ")[1].split()[0]
    assert f" {judged}  >  1e-12\n" in out and "||err||/||ref||  bound" in out
    assert main(["check", "--tolerance", "1e-12", "--no-stop-on-failure"]) == 1
    out = capsys.readouterr().out
    assert out.count("^ FAILED") == 8 and "2 of 10 cases within --tolerance; 8 FAILED" in out
    assert main(["check", "--tolerance", "1e-3"]) == 0


def test_block_sizes_in_run(problem):
    assert main(["run", "--compute", "fa2", "--mode", "both", "--block-m", "16", "--block-n", "32",
                 "--data", str(problem)]) == 0
    shape = (2, 3, 70, 24)
    q, k, v = (read_tensor(problem / f"{n}.bin", shape, torch.float32).transpose(1, 2).double() for n in "QKV")
    ref, _ = attention_reference(q, k, v)
    assert (read_tensor(problem / "O.bin", shape, torch.float32).double() - ref.transpose(1, 2)).abs().max() < 1e-5


def test_experiment_writes_one_table(tmp_path, capsys):
    assert main(["experiment", "--seqlens", "32,64", "--modes", "fwd", "--out", str(tmp_path)]) == 0
    import csv
    rows = list(csv.DictReader(open(tmp_path / "experiment.csv")))
    assert {r["provider"] for r in rows} >= {"naive (cpu)", "fa1 (cpu)", "fa2 (cpu)", "torch (cpu)"}
    assert all(float(r["rel_err"]) < 1e-5 for r in rows) and (tmp_path / "experiment.png").stat().st_size > 0


@pytest.mark.gpu
def test_cli_run_and_check_on_gpu(tmp_path, capsys):
    from cuflash.cli import main
    assert main(["generate", "--batch-size", "2", "--num-heads", "4", "--seq-len", "1000", "--head-dim", "64",
                 "--dtype", "bfloat16", "--output-dir", str(tmp_path)]) == 0
    for method in ("naive", "fa1", "fa2"):
        assert main(["run", "--compute", method, "--mode", "both", "--causal", "--device", "cuda",
                     "--data", str(tmp_path / "B2_H4_S1000_D64")]) == 0
    assert "on cuda" in capsys.readouterr().out
    assert main(["check"]) == 0
    assert "30 of 30 cases within the bounds" in capsys.readouterr().out
