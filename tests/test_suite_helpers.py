"""The test suite's own machinery where it can go wrong silently: the lock that keeps big float64
oracles from running at once on the GPU that the suite's workers share."""
import threading
import time

import torch

from attn_testing import BIG_ORACLE_BYTES, big_oracle, one_at_a_time


def test_one_at_a_time_holds_the_others_back():
    """A second holder waits until the first lets go (separate opens of the lock file, as separate
    processes have)."""
    held = threading.Event()
    released_at = []

    def first():
        with one_at_a_time("cuflash-test-lock"):
            held.set()
            time.sleep(0.3)
            released_at.append(time.monotonic())
    thread = threading.Thread(target=first)
    thread.start()
    held.wait()
    with one_at_a_time("cuflash-test-lock"):
        entered = time.monotonic()
    thread.join()
    assert entered >= released_at[0]


def test_big_oracle_locks_only_big_gpu_oracles(monkeypatch):
    """Off the GPU, or under BIG_ORACLE_BYTES of scores, no lock is taken (the CPU suite never waits);
    on the GPU, over it, the lock is."""
    import attn_testing
    taken = []
    monkeypatch.setattr(attn_testing, "one_at_a_time", lambda name: taken.append(name) or threading.Lock())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = BIG_ORACLE_BYTES // 8 // 1024 + 1  # query rows x 1024 keys x 8 bytes: just over the bound
    big_q, keys = torch.empty(1, rows, 1, 8, device="meta"), torch.empty(1, 1024, 1, 8, device="meta")
    for q, k in ((big_q, keys), (big_q[:, :-1], keys)):
        with big_oracle(q, k):
            pass
    assert taken == []  # (meta tensors: not on the GPU)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda")))
    with big_oracle(big_q[:, :-1], keys):
        pass
    assert taken == []
    with big_oracle(big_q, keys):
        pass
    assert taken == ["cuflash-big-oracle"]
