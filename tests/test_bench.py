"""The benchmark harness on the CPU: rows, CSV, markdown table and plot."""
import csv
import time

import pytest
import torch

from cuflash.cli import main as cli_main


def main(argv):
    """`cuflash bench argv`: its exit status."""
    return cli_main(["bench", *argv])


def csv_rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_cpu_bench_writes_csv_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = main(["--device", "cpu", "--providers", "cuflash,sdpa", "--seqlens", "64,128", "--hdims", "16",
               "--batch", "1", "--nheads", "2", "--dtype", "fp32", "--modes", "fwd,fwd+bwd", "--iters", "2",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = csv_rows(tmp_path / "results.csv")
    assert len(rows) == 2 * 2 * 2 * 2  # providers x seqlens x modes x causal
    assert all(float(r["ms"]) > 0 and float(r["rel_err"]) < 1e-5 for r in rows)
    table = (tmp_path / "results.md").read_text()
    assert "vs sdpa" in table and table.count("\n| none | fwd |") == 4 and table.count("\n| none | fwd+bwd |") == 4
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert "cuflash GFLOP/s" in capsys.readouterr().out


def test_plot_of_a_flex_sweep(tmp_path):
    """`python -m cuflash.bench.plot` on `bench --flex`'s CSV (told apart by its columns): a panel per mod
    and pass, wider with more mods."""
    pytest.importorskip("matplotlib")
    from cuflash.bench.plot import main as plot_main

    def sweep(mods):
        path = tmp_path / f"flex_{len(mods)}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["mod", "provider", "seqlen", "head_dim", "fwd_tflops",
                                                   "bwd_tflops"])
            writer.writeheader()
            writer.writerows(dict(mod=m, provider=p, seqlen=n, head_dim=128, fwd_tflops=100 + n / 100,
                                  bwd_tflops=80) for m in mods for p in ("cuflash-flex", "torch-flex")
                             for n in (2048, 4096))
        assert plot_main([str(path)]) == 0
        from PIL import Image
        return Image.open(path.with_suffix(".png")).size
    one, four = sweep(["causal"]), sweep(["causal", "alibi", "softcap", "document"])
    assert four[0] > 1.9 * one[0] and four[1] > 1.9 * one[1]  # 2 x 1 panels against 4 x 2


def test_cpu_bench_value_head_dim(tmp_path):
    """--hdims D:Dv times v's head dim apart (DeepSeek's 192:128) beside a plain D: both providers run
    it, the FLOPs count QK^T over D and PV over Dv (FlashAttention-3's count), the table names it D:Dv."""
    from cuflash.bench.harness import Case
    rc = main(["--device", "cpu", "--providers", "cuflash,sdpa", "--seqlens", "64", "--hdims", "24:16,16",
               "--batch", "1", "--nheads", "2", "--dtype", "fp32", "--modes", "fwd,bwd", "--iters", "2",
               "--causal", "false", "--out", str(tmp_path)])
    assert rc == 0
    rows = csv_rows(tmp_path / "results.csv")
    assert {(r["head_dim"], r["head_dim_v"]) for r in rows} == {("24", "16"), ("16", "16")}
    assert all(float(r["ms"]) > 0 and float(r["rel_err"]) < 1e-5 for r in rows), [r["note"] for r in rows]
    assert "| 24:16 | 64 |" in (tmp_path / "results.md").read_text()
    fwd, bwd = (Case(1, 64, 2, 24, False, torch.float32, mode, head_dim_v=16).flops() for mode in ("fwd", "bwd"))
    assert fwd == 2 * 2 * 64 * 64 * (24 + 16) and bwd == 2 * 2 * 64 * 64 * (3 * 24 + 2 * 16)
    assert Case(1, 64, 2, 16, False, torch.float32, "bwd").flops() == 2.5 * 4 * 2 * 64 * 64 * 16


def test_cpu_bench_variants(tmp_path):
    rc = main(["--device", "cpu", "--providers", "cuflash,sdpa", "--seqlens", "64", "--hdims", "16", "--batch", "1",
               "--nheads", "2", "--dtype", "fp32", "--modes", "fwd", "--iters", "2", "--causal", "true",
               "--variants", "window,alibi,softcap,mask,dropout", "--out", str(tmp_path)])
    assert rc == 0
    rows = {(r["provider"], r["variant"]): r for r in csv_rows(tmp_path / "results.csv")}
    assert len(rows) == 10
    assert "no softcap" in rows["sdpa", "softcap"]["note"]
    for (provider, variant), r in rows.items():
        if (provider, variant) != ("sdpa", "softcap"):
            assert float(r["ms"]) > 0, (provider, variant, r["note"])
        if variant != "dropout" and r["rel_err"]:
            assert float(r["rel_err"]) < 1e-5, (provider, variant)
    assert rows["cuflash", "dropout"]["rel_err"] == ""


def test_fa4_provider(monkeypatch, capsys):
    """fa4 runs FlashAttention-4's flash_attn_func ((B, N, H, D) in, (out, lse) out) on the variants it
    takes; without it the row says so; on the CPU it is left out with a note. A stand-in module (our own
    kernels behind FA4's signature) checks the layout and the options handed over."""
    import sys
    import types

    import cuflash
    from cuflash.bench import harness

    harness.fa4_version.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # (an import of it fails)
    case = harness.Case(1, 64, 2, 16, True, torch.float32, "fwd")
    assert "does not import" in harness.run_case("fa4", case, "cpu", iters=1, warmup=0)["note"]
    assert main(["--device", "cpu", "--providers", "cuflash,fa4", "--seqlens", "32", "--hdims", "16", "--batch",
                 "1", "--nheads", "2", "--modes", "fwd", "--iters", "1", "--causal", "true"]) == 0
    assert "fa4 run on CUDA only: left out" in capsys.readouterr().err

    def fa4(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0):
        window = tuple(-1 if w is None else w for w in window_size)
        return cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap), None

    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, package.cute = fa4, cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    harness.fa4_version.cache_clear()
    assert harness.fa4_version() == "unknown version"  # (no package metadata)
    for variant in ("none", "window", "softcap"):
        for mode in ("fwd", "fwd+bwd"):
            row = harness.run_case("fa4", harness.Case(1, 64, 2, 16, True, torch.float32, mode, variant), "cpu",
                                   iters=1, warmup=0)
            assert row["ms"] > 0 and row["rel_err"] < 1e-5, (variant, mode, row)
    assert "n/a" in harness.run_case("fa4", harness.Case(1, 64, 2, 16, True, torch.float32, "fwd", "alibi"),
                                     "cpu")["note"]
    harness.fa4_version.cache_clear()


def test_unknown_provider_is_refused(capsys):
    assert main(["--device", "cpu", "--providers", "cuflash,fastest"]) == 2
    assert "argument --providers: 'fastest' is not one of" in capsys.readouterr().err


def test_methods_side_by_side_on_cpu(tmp_path):
    """naive, fa1 and fa2 (cuflash) as bench providers: every row timed and exact."""
    rc = main(["--device", "cpu", "--providers", "naive,fa1,cuflash", "--seqlens", "64,96", "--hdims", "64",
               "--batch", "1", "--nheads", "2", "--modes", "fwd,fwd+bwd", "--dtype", "fp32", "--iters", "1",
               "--causal", "true", "--out", str(tmp_path)])
    assert rc == 0
    rows = csv_rows(tmp_path / "results.csv")
    assert {r["provider"] for r in rows} == {"naive", "fa1", "cuflash"} and len(rows) == 3 * 2 * 2
    assert all(float(r["ms"]) > 0 and float(r["rel_err"]) < 1e-5 for r in rows)


def test_decode_mode_on_cpu(tmp_path, capsys):
    rc = main(["--decode", "--device", "cpu", "--dtype", "fp32", "--batches", "2", "--cache-lens", "64",
               "--seqlen-q", "1,4", "--layouts", "contiguous,paged16", "--nheads", "4", "--nheads-k", "2",
               "--head-dim", "16", "--iters", "2", "--providers", "cuflash,sdpa", "--out", str(tmp_path)])
    assert rc == 0
    rows = csv_rows(tmp_path / "decode.csv")
    # per seqlen_q: cuflash and sdpa on the contiguous cache, cuflash on the paged one
    assert sorted((r["provider"], r["layout"]) for r in rows) == sorted(
        [("cuflash", "contiguous"), ("sdpa", "contiguous"), ("cuflash", "paged16")] * 2)
    assert all(float(r["ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    table = (tmp_path / "decode.md").read_text()
    assert "copy bandwidth" in table and table.count("| paged16 |") == 2 and "vs best SDPA" in table


def test_cpu_bench_host_column(tmp_path):
    """The table's host time column: n/a on the CPU, where the wall time is the time."""
    rc = main(["--device", "cpu", "--providers", "cuflash", "--seqlens", "64", "--hdims", "16", "--batch", "1",
               "--nheads", "2", "--dtype", "fp32", "--modes", "fwd", "--causal", "false", "--iters", "2",
               "--out", str(tmp_path)])
    assert rc == 0
    table = (tmp_path / "results.md").read_text()
    assert "| cuflash err | cuflash host us |" in table and table.rstrip().endswith("| n/a |")


def test_bench_without_a_gpu_picks_the_cpu_and_says_so(monkeypatch, capsys, tmp_path):
    """No GPU and no --device: the CPU path, the providers that run there (sdpa-cudnn and
    sdpa-efficient are CUDA-only), fp32 and a short sweep, each choice printed; --dtype takes either name."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--seqlens", "64", "--modes", "fwd", "--causal", "false", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "cuflash bench on cpu:" in err and "dtype fp32" in err and "providers cuflash,sdpa-flash,sdpa" in err
    rows = csv_rows(tmp_path / "results.csv")
    assert [r["provider"] for r in rows] == ["cuflash", "sdpa-flash", "sdpa"] and all(r["tflops"] for r in rows)
    assert main(["--device", "cpu", "--providers", "cuflash,sdpa-cudnn", "--dtype", "float32",
                       "--seqlens", "64", "--modes", "fwd", "--causal", "false"]) == 0
    assert "sdpa-cudnn run on CUDA only: left out" in capsys.readouterr().err
    assert main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.gpu
def test_bench_times_the_device_not_the_host():
    """A call whose host work (3 ms) outlasts its kernel: the bench's device time is the kernel's,
    its host time the 3 ms; timed with events around each call as it runs, it would read ~3 ms."""
    from cuflash.bench.harness import device_ms_host_us, median_ms
    x = torch.randn(1 << 20, device="cuda")

    def step(i):
        time.sleep(0.003)
        x.mul_(1.0)

    ms, host_us = device_ms_host_us(step, 10, 2, torch.device("cuda"))
    assert ms < 0.5 and host_us > 2900, (ms, host_us)
    assert median_ms(step, 10, 2, torch.device("cuda")) > 2.5  # what the events alone would say


def cut_short_in_the_third_case(monkeypatch, module) -> list:
    """Make `module.run_case` raise KeyboardInterrupt (Ctrl-C, or a time limit) in its third call; the
    calls' arguments, as made."""
    import importlib
    target = importlib.import_module(module)
    real, calls = target.run_case, []

    def cut_short(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "run_case", cut_short)
    return calls


@pytest.mark.parametrize("decode,module,csv_name", [(False, "cuflash.bench.__main__", "results.csv"),
                                                    (True, "cuflash.bench.decode", "decode.csv")])
def test_a_sweep_cut_short_keeps_what_it_measured(decode, module, csv_name, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the third case: the CSV holds the two cases measured before it, as they were
    measured, and the command exits 130."""
    calls = cut_short_in_the_third_case(monkeypatch, module)
    args = (["--decode", "--batches", "1", "--cache-lens", "32,64,96", "--layouts", "contiguous", "--nheads", "2",
             "--nheads-k", "1", "--head-dim", "16"] if decode else
            ["--seqlens", "32,64,96", "--hdims", "16", "--batch", "1", "--nheads", "2", "--modes", "fwd",
             "--causal", "false"])
    rc = main([*args, "--device", "cpu", "--providers", "cuflash", "--dtype", "fp32", "--iters", "1",
               "--out", str(tmp_path)])
    assert rc == 130 and len(calls) == 3
    rows = csv_rows(tmp_path / csv_name)
    lengths = [r["cache_len" if decode else "seqlen"] for r in rows]
    assert lengths == ["32", "64"] and all(float(r["ms"]) > 0 for r in rows)


def test_experiment_cut_short_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    """The same for `cuflash experiment` (its run_case is the harness's, looked up at the call)."""
    calls = cut_short_in_the_third_case(monkeypatch, "cuflash.bench.harness")
    assert cli_main(["experiment", "--seqlens", "32", "--modes", "fwd", "--out", str(tmp_path)]) == 130
    assert len(calls) == 3
    rows = csv_rows(tmp_path / "experiment.csv")
    assert [r["provider"] for r in rows] == ["naive (cpu)", "fa1 (cpu)"] and all(float(r["ms"]) > 0 for r in rows)
