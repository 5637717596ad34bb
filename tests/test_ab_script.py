"""scripts/ab.py's reading of ncu's --csv output, which its --ncu mode relies on (the A/B runs on the
GPU machine itself cannot run here)."""
import runpy
from pathlib import Path

import pytest

AB = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "ab.py"), run_name="ab")

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(metric: str, unit: str, value: str) -> str:
    return (f'"0","4242","python3.12","127.0.0.1","_attn_bwd_dkdv_hopper","1","7","(288, 1, 1)","(132, 1, 1)","0",'
            f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"')


def test_parse_ncu_reads_each_metric_by_its_short_name():
    text = "\n".join(["==PROF== Connected to process 4242", '==PROF== Profiling "_attn_bwd_dkdv_hopper" - 0: 0%',
                      HEADER, _row("gpu__time_duration.sum", "ns", "2,760,928"),
                      _row("sm__cycles_elapsed.max", "cycle", "4055966"),
                      _row("smsp__inst_executed.sum", "inst", "492163346"), "==PROF== Disconnected from process 4242"])
    assert AB["parse_ncu"](text) == {"time_ns": 2760928.0, "sm_cycles": 4055966.0, "instructions": 492163346.0}


def test_parse_ncu_names_what_is_missing():
    """A kernel regex that matched nothing (or the wrong launch count) leaves metrics out: said, not zero."""
    text = "\n".join([HEADER, _row("gpu__time_duration.sum", "ns", "100")])
    with pytest.raises(RuntimeError, match="ncu reported"):
        AB["parse_ncu"](text)


def test_a_missing_baseline_is_named(tmp_path, monkeypatch, capsys):
    """Without .baseline/src (a git-ignored folder a device call takes only where carry names it) ab.py says
    which tree is missing and how to make it, instead of printing its usage."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["ab.py", str(tmp_path / "out"), "--ncu", "bwd"])
    assert AB["main"]() == 2
    err = capsys.readouterr().err
    assert "no baseline tree at .baseline/src" in err and "carry" in err and not (tmp_path / "out").exists()
