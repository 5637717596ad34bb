"""The `cuflash` command at its edges: every problem ends as one line on stderr naming it, exit
status 2 (130 for Ctrl-C, quiet 141 for a closed pipe), and no half-written problem folder."""
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuflash import cli, commandline, datafiles, methods
from cuflash.bench import harness
from cuflash.cli import main
from cuflash.datafiles import DERIVED, read_tensor
from cuflash.reference import attention_reference

GENERATE = ["generate", "--batch-size", "1", "--num-heads", "2", "--seq-len", "20", "--head-dim", "16"]
SHAPE = (1, 2, 20, 16)


def _cli(argv, capsys):
    """The exit status of `cuflash argv` run in-process (main returns it, argparse's included) and what it printed."""
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])


@contextlib.contextmanager
def _read_only(folder: Path):
    """The folder made read-only for the block; the test is skipped where the user writes into it
    anyway (root, unless it runs without CAP_DAC_OVERRIDE)."""
    folder.chmod(0o555)
    try:
        try:
            (folder / ".probe").touch()
        except PermissionError:
            yield
        else:
            (folder / ".probe").unlink()
            pytest.skip("this user writes into read-only folders")
    finally:
        folder.chmod(0o755)


def _snapshot(folder: Path) -> dict:
    """Every entry of the folder (temporary files included) with the bytes of the files."""
    return {p.name: p.read_bytes() if p.is_file() else "folder" for p in folder.iterdir()}


@pytest.fixture
def small(tmp_path):
    assert main(GENERATE + ["--seed", "3", "--output-dir", str(tmp_path / "data")]) == 0
    return tmp_path / "data" / "B1_H2_S20_D16"


@pytest.fixture
def no_sweep(monkeypatch):
    """The bench, its decode sweep and experiment time nothing: an argument error must stop them first."""
    import cuflash.bench.__main__ as bench_cli
    from cuflash.bench import decode

    def swept(*args, **kwargs):
        raise AssertionError("the sweep ran")

    for module, name in ((harness, "run_case"), (bench_cli, "run_case"), (decode, "run_case"),
                         (decode, "copy_bandwidth")):
        monkeypatch.setattr(module, name, swept)


# -- run: check first, write each file under a temporary name, record what completed ---------------

def _counting_forward(monkeypatch) -> list:
    calls: list = []
    real = methods.forward
    monkeypatch.setattr(methods, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def test_run_refuses_a_folder_where_an_output_is_a_directory_before_computing(small, capsys, monkeypatch):
    (small / "dK.bin").mkdir()
    before = _snapshot(small)
    computed = _counting_forward(monkeypatch)
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 2 and not computed
    _one_line(err, "cuflash run:", "dK.bin")
    assert _snapshot(small) == before


def test_run_refuses_a_read_only_folder_before_computing(small, capsys, monkeypatch):
    before = _snapshot(small)
    computed = _counting_forward(monkeypatch)
    with _read_only(small):
        rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 2 and not computed
    _one_line(err, "cuflash run:", str(small))
    assert _snapshot(small) == before


def test_a_write_that_fails_midway_records_only_what_completed(small, capsys, monkeypatch):
    """The third rename fails (the disk filled up): the two files renamed before it are in place and
    recorded, the others are neither written nor recorded, and no temporary file is left."""
    real, renamed = os.replace, []

    def replace(src, dst):
        if len(renamed) == 2:
            renamed.append(None)
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        renamed.append(Path(dst).name)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 2
    _one_line(err, "cuflash run:", "No space left on device")
    done = set(renamed[:2])
    assert len(done) == 2 and done <= set(DERIVED)
    assert set(json.loads((small / "meta.json").read_text())["files"]) == done
    assert {p.name for p in small.iterdir()} == {"Q.bin", "K.bin", "V.bin", "meta.json"} | done


# -- run's float64 reference: O(N) memory, sampled past a size, progress ----------------------------

def _reported_errors(out: str) -> list[float]:
    return [float(line.split("max abs ")[1].split()[0]) for line in out.splitlines() if "max abs" in line]


def _product_sizes(monkeypatch) -> list:
    """The sizes of the results of torch.einsum and torch.matmul (the float64 reference's products)."""
    sizes: list = []
    for name in ("einsum", "matmul"):
        real = getattr(torch, name)

        def spy(*args, real=real, **kwargs):
            result = real(*args, **kwargs)
            sizes.append(result.numel())
            return result

        monkeypatch.setattr(torch, name, spy)
    return sizes


def test_run_reference_holds_a_block_of_query_rows_at_a_time(tmp_path, capsys, monkeypatch):
    """With room for the scores of 3 query rows (both heads), no step of the float64 reference holds
    more than that or one input's worth (64 x 64 scores: 8192 values, an input 512), and the errors
    it reports stay at fp32 rounding: the blocks add up to the whole."""
    assert main(["generate", "--num-heads", "2", "--seq-len", "64", "--head-dim", "4",
                 "--output-dir", str(tmp_path)]) == 0
    monkeypatch.setattr(cli, "SCORES_BUDGET", 2 * 64 * 3)
    sizes = _product_sizes(monkeypatch)
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--causal",
                         "--data", str(tmp_path / "B1_H2_S64_D4")], capsys)
    assert rc == 0 and sizes and max(sizes) <= 2 * 64 * 4
    assert len(_reported_errors(out)) == 4 and max(_reported_errors(out)) < 1e-5, out


def test_float64_reference_matches_the_oracle_in_blocks(monkeypatch):
    monkeypatch.setattr(cli, "SCORES_BUDGET", 2 * 3 * 37 * 4)  # four query rows of every head at a time
    q, k, v, dout = (torch.randn(2, 37, 3, 8) for _ in range(4))
    for causal in (False, True):
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = attention_reference(qd, kd, vd, causal=causal)
        grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
        ours = cli.float64_reference(q, k, v, dout, causal)
        for name, want in zip(("out", "lse", "dQ", "dK", "dV"), (ref, ref_lse) + grads):
            assert ours[name].dtype == torch.float64 and torch.allclose(ours[name], want, atol=1e-12), name
        rows = torch.tensor([0, 5, 36])
        some = cli.float64_reference(q, k, v, dout, causal, rows)
        assert set(some) == {"out", "lse", "dQ"}  # (dK, dV need every query row)
        for name, want in (("out", ref[:, rows]), ("lse", ref_lse[:, :, rows]), ("dQ", grads[0][:, rows])):
            assert torch.allclose(some[name], want, atol=1e-12), name


def test_run_samples_heads_then_rows_past_the_reference_budget(small, capsys, monkeypatch):
    """Past the budget: every output on some of the heads while one head fits; past that, out and
    dQ on evenly spaced query rows of every head and dK, dV not checked; each said on stdout."""
    one_head = 1 * 20 * 20 * 16  # batch x N x N x D
    monkeypatch.setattr(cli, "REFERENCE_WORK", one_head)
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 0 and "1 of 2 heads" in out and "dK" in out
    assert len(_reported_errors(out)) == 4 and max(_reported_errors(out)) < 1e-5, out
    monkeypatch.setattr(cli, "REFERENCE_WORK", one_head // 2)  # 5 query rows of the two heads
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 0 and "5 of 20 query rows" in out and "dK, dV not checked" in out
    assert len(_reported_errors(out)) == 2 and max(_reported_errors(out)) < 1e-5, out
    # the sampled rows are compared with the rows they are: a wrong output row shows
    real = methods.forward

    def wrong_last_row(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        out[:, -1] += 1.0
        return out, lse

    monkeypatch.setattr(methods, "forward", wrong_last_row)
    rc, out, err = _cli(["run", "--compute", "fa2", "--data", str(small)], capsys)
    assert rc == 0 and _reported_errors(out)[0] == pytest.approx(1.0, rel=1e-5)


def test_run_prints_progress_on_stderr_past_a_few_seconds(small, capsys, monkeypatch):
    monkeypatch.setattr(commandline, "PROGRESS_AFTER_S", 0.0)
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 0 and "float64 reference" in err and "fa2 backward" in err and "Traceback" not in err


# -- meta.json values of the wrong type -------------------------------------------------------------

@pytest.mark.parametrize("edit,field", [
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(files=[]), "files"),
    (dict(files={"dO.bin": 5}), "files"),
    (dict(dtype=["fp32"]), "dtype"),
])
def test_meta_values_of_the_wrong_type_name_the_field(small, capsys, edit, field):
    meta = json.loads((small / "meta.json").read_text())
    (small / "meta.json").write_text(json.dumps({**meta, **edit}))
    before = _snapshot(small)
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 2
    _one_line(err, "meta.json", field)
    assert _snapshot(small) == before


def test_meta_that_is_not_utf8_is_one_line(small, capsys):
    (small / "meta.json").write_bytes(b'{"seed": "\xff\xfe"}')
    rc, out, err = _cli(["run", "--compute", "fa2", "--data", str(small)], capsys)
    assert rc == 2
    _one_line(err, "meta.json", "UTF-8")


# -- generate: sizes checked first, nothing created; replaced atomically --------------------------

def test_generate_larger_than_memory_creates_nothing(tmp_path, capsys):
    rc, out, err = _cli(["generate", "--batch-size", "4096", "--num-heads", "4096", "--seq-len", "1048576",
                         "--head-dim", "256", "--output-dir", str(tmp_path / "data")], capsys)
    assert rc == 2
    _one_line(err, "cuflash generate:", "memory")
    assert not (tmp_path / "data").exists()


def test_generate_larger_than_the_disk_creates_nothing(tmp_path, capsys, monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    rc, out, err = _cli(GENERATE + ["--output-dir", str(tmp_path / "data")], capsys)
    assert rc == 2
    _one_line(err, "cuflash generate:", "disk")
    assert not (tmp_path / "data").exists()


def test_interrupted_generate_leaves_the_problem_it_would_replace(small, capsys, monkeypatch):
    """Ctrl-C while K is drawn: the old Q, K, V, meta.json and the outputs of a run stay as they were
    (no new Q.bin beside the old K, V and seed), one line says so, exit status 130."""
    assert main(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)]) == 0
    before = _snapshot(small)
    real, drawn = datafiles.random_tensor, []

    def interrupted(*args):
        drawn.append(args)
        if len(drawn) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(datafiles, "random_tensor", interrupted)
    rc, out, err = _cli(GENERATE + ["--seed", "4", "--output-dir", str(small.parent)], capsys)
    assert rc == 130 and len(drawn) == 2
    _one_line(err, "cuflash generate:", "interrupted")
    assert _snapshot(small) == before


def test_interrupted_generate_of_a_new_folder_leaves_no_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(datafiles, "random_tensor", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    rc, out, err = _cli(GENERATE + ["--output-dir", str(tmp_path / "a" / "b")], capsys)
    assert rc == 130 and not (tmp_path / "a").exists()


def test_ctrl_c_while_files_are_renamed_waits_until_the_problem_is_whole(small, capsys, monkeypatch):
    """A Ctrl-C that comes while generate renames its files into place is held until meta.json is
    written: the folder then holds the new problem, whole, and the command exits 130."""
    real = os.replace

    def replace(src, dst):
        if Path(dst).parent == small:  # (not another rename in the process, outside the held block)
            signal.raise_signal(signal.SIGINT)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    rc, out, err = _cli(GENERATE + ["--seed", "4", "--output-dir", str(small.parent)], capsys)
    monkeypatch.undo()
    assert rc == 130
    _one_line(err, "cuflash generate:", "interrupted")
    assert json.loads((small / "meta.json").read_text())["seed"] == 4
    for i, name in enumerate("QKV"):
        assert torch.equal(read_tensor(small / f"{name}.bin", SHAPE, torch.float32),
                           datafiles.random_tensor(SHAPE, torch.float32, 4 + i))


def test_interrupted_run_writes_nothing(small, capsys, monkeypatch):
    before = _snapshot(small)
    monkeypatch.setattr(methods, "backward", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    rc, out, err = _cli(["run", "--compute", "fa2", "--mode", "both", "--data", str(small)], capsys)
    assert rc == 130
    _one_line(err, "cuflash run:", "interrupted")
    assert _snapshot(small) == before


def test_sigint_exits_130_with_one_line(tmp_path):
    """A real SIGINT while generate draws its inputs."""
    script = ("import sys, time\n"
              "from cuflash import datafiles\n"
              "from cuflash.cli import main\n"
              "def slow(*args):\n"
              "    print('drawing', flush=True)\n"
              "    time.sleep(120)\n"
              "datafiles.random_tensor = slow\n"
              "sys.exit(main(sys.argv[1:]))\n")
    child = subprocess.Popen([sys.executable, "-c", script] + GENERATE + ["--output-dir", str(tmp_path / "data")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "drawing\n"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130
    _one_line(err, "cuflash generate:", "interrupted")
    assert not (tmp_path / "data").exists()


# -- arguments: argparse-level errors naming the flag and what it accepts ---------------------------

@pytest.mark.parametrize("argv,words", [
    (["experiment", "--modes", "foo"], ["--modes", "fwd+bwd"]),
    (["experiment", "--batch", "0"], ["--batch", ">= 1"]),
    (["experiment", "--nheads", "-1"], ["--nheads", ">= 1"]),
    (["experiment", "--seqlens", "128,0"], ["--seqlens", ">= 1"]),
    (["bench", "--seqlens", "0"], ["--seqlens", ">= 1"]),
    (["bench", "--modes", "foo"], ["--modes", "fwd+bwd"]),
    (["bench", "--hdims", "600"], ["--hdims", "1 to 512"]),
    (["bench", "--iters", "0"], ["--iters", ">= 1"]),
    (["bench", "--batch", "0"], ["--batch", ">= 1"]),
    (["bench", "--providers", "cuflash,fastest"], ["--providers", "sdpa-flash"]),
    (["bench", "--hidden", "64", "--hdims", "128"], ["--hidden", "128"]),
    (["bench", "--decode", "--batches", "0"], ["--batches", ">= 1"]),
    (["bench", "--decode", "--layouts", "paged0"], ["--layouts", "paged"]),
])
def test_bad_bench_and_experiment_arguments(argv, words, capsys, no_sweep):
    rc, out, err = _cli(argv + ["--device", "cpu"] if argv[0] == "bench" else argv, capsys)
    assert rc == 2
    _one_line(err, *words)


@pytest.mark.parametrize("command", [["experiment"], ["bench", "--device", "cpu"],
                                     ["bench", "--decode", "--device", "cpu"]])
def test_an_out_that_cannot_be_written_is_refused_before_the_sweep(command, tmp_path, capsys, no_sweep):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, out, err = _cli(command + ["--out", str(blocker / "sub")], capsys)
    assert rc == 2
    _one_line(err, "--out", str(blocker))


def test_a_read_only_out_is_refused_before_the_sweep(tmp_path, capsys, no_sweep):
    with _read_only(tmp_path):
        rc, out, err = _cli(["experiment", "--out", str(tmp_path / "exp")], capsys)
    assert rc == 2
    _one_line(err, "--out")


# -- pipes and the environment ------------------------------------------------------------------------

def test_a_closed_pipe_ends_quietly():
    """`cuflash info | head -0`: the reader is gone before the first line; no BrokenPipeError."""
    read, write = os.pipe()
    os.close(read)
    try:
        child = subprocess.run([sys.executable, "-m", "cuflash", "info"], stdout=write, stderr=subprocess.PIPE,
                               text=True, timeout=120)
    finally:
        os.close(write)
    assert child.returncode == 141 and child.stderr == ""


class _ClosedPipe:
    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self):
        pass


@pytest.mark.parametrize("argv", [["info"], GENERATE + ["--seed", "5"], ["run", "--compute", "naive"]])
def test_a_closed_pipe_ends_every_command_quietly(argv, small, capsys, monkeypatch):
    argv = argv + (["--data", str(small)] if argv[0] == "run" else [])
    argv = argv + (["--output-dir", str(small.parent)] if argv[0] == "generate" else [])
    monkeypatch.setattr(commandline, "PROGRESS_AFTER_S", 1e9)  # (no progress line on stderr, however slow the machine)
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    rc, out, err = _cli(argv, capsys)
    assert rc == 141 and err == ""


def test_a_bad_backend_variable_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "foo")
    rc, out, err = _cli(["info"], capsys)
    assert rc == 2 and out == ""
    _one_line(err, "cuflash info:", "CUFLASH_BACKEND='foo'", "auto, triton, cpu")


# -- help, version, names ------------------------------------------------------------------------------

def test_bench_help_names_the_command_it_was_reached_through(capsys):
    rc, out, err = _cli(["bench", "-h"], capsys)
    assert rc == 0 and out.startswith("usage: cuflash bench")
    assert "(default:cuflash,sdpa-cudnn,sdpa-flash)" in _joined(out)
    rc, out, err = _cli(["bench", "--decode", "-h"], capsys)
    assert rc == 0 and out.startswith("usage: cuflash bench --decode")
    from cuflash.bench.__main__ import main as bench_main
    with pytest.raises(SystemExit):
        bench_main(["-h"])
    assert capsys.readouterr().out.startswith("usage: python -m cuflash.bench")


def _joined(text: str) -> str:
    """The text without its white space (help wraps where the terminal is narrow)."""
    return "".join(text.split())


def test_help_shows_the_defaults(capsys):
    rc, out, err = _cli(["generate", "-h"], capsys)
    assert rc == 0 and "(default:1024)" in _joined(out) and "(default:data)" in _joined(out)
    rc, out, err = _cli(["experiment", "-h"], capsys)
    assert rc == 0 and "(default:128,256,512,1024)" in _joined(out) and "(default:None)" not in _joined(out)


def test_version(capsys):
    from importlib.metadata import PackageNotFoundError, version
    import cuflash
    try:
        expected = version("cuflash-attn")
    except PackageNotFoundError:
        expected = cuflash.__version__
    rc, out, err = _cli(["--version"], capsys)
    assert rc == 0 and out.strip() == f"cuflash {expected}"


def test_experiment_names_its_providers_one_way(tmp_path, capsys, monkeypatch):
    """The progress line, the table and the CSV all say naive, fa1, fa2, torch."""
    def row(provider, case, device, iters, warmup):
        return {"provider": provider, "batch": case.batch, "seqlen": case.seqlen, "nheads": case.nheads,
                "head_dim": case.head_dim, "causal": case.causal, "mode": case.mode, "variant": case.variant,
                "ms": 1.0, "tflops": 1.0, "rel_err": 0.0, "note": ""}

    monkeypatch.setattr(harness, "run_case", row)
    rc, out, err = _cli(["experiment", "--seqlens", "16", "--modes", "fwd", "--out", str(tmp_path)], capsys)
    assert rc == 0
    named = {"naive", "fa1", "fa2", "torch"}
    assert {line.split()[0] for line in out.splitlines()[1:5]} == named, out
    assert "cuflash" not in err and "sdpa" not in err and all(f"{name} on cpu" in err for name in named), err
