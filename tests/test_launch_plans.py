"""Launch plans (kernels/launch.py) and the call signatures that keep them (memo.py): reuse per
signature, workspaces, arguments, the compiled launcher, bounded tables; on the GPU from other
threads, with launch hooks and with inputs on a GPU other than the current one."""
import pytest
import torch

import cuflash
from attn_testing import check_against_oracle, count_plan_lookups, flash_fn, interpret, make_qkv, rel_err, run_and_grad
from cuflash.params import AttentionParams
from cuflash.reference import attention_reference


@interpret
def test_launch_plans_are_reused_per_signature_and_hold_no_tensors():
    """A launch plan keeps every argument of a signature's first call but its tensors: later
    calls with new data reuse it, new strides, options or a misaligned base make a new one, and
    the first call's tensors are not kept alive."""
    import gc
    import weakref

    from cuflash.kernels import attention_backward, attention_forward
    from cuflash.kernels import launch

    def check(q, k, v, causal):
        params = AttentionParams(40 ** -0.5, window_right=0 if causal else -1)
        dout = torch.randn_like(q)

        def ours(a, b, c):
            out, lse = attention_forward(a, b, c, params)
            return (out,) + attention_backward(dout, a, b, c, out, lse, params)

        ref = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=causal)[0],
                           q.double(), k.double(), v.double(), dout.double())
        for got, want in zip(ours(q, k, v), ref):
            assert rel_err(got, want) < 1e-5

    launch.PLANS.clear()
    torch.manual_seed(5)
    first = make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu")
    check(*first, True)
    assert len(launch.PLANS) == 2  # forward, backward
    watch = weakref.ref(first[0])
    del first
    gc.collect()
    assert watch() is None
    check(*make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu"), True)  # new data: the same plans
    assert len(launch.PLANS) == 2
    check(*make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu"), False)  # another option
    assert len(launch.PLANS) == 4
    check(*make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu", layout="bhnd"), True)  # other strides
    assert len(launch.PLANS) == 6
    q, k, v = make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu")
    shifted = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)  # base 4 bytes past 16-byte alignment
    check(shifted, k, v, True)
    assert len(launch.PLANS) == 8


@interpret
def test_public_calls_launch_their_signature_plans_directly(monkeypatch):
    """flash_attn_func and scaled_dot_product_attention keep the launch plans of each checked call
    signature (memo.py, ops.forward): a later call of the signature launches them without launch()'s
    lookup, forward and backward, and computes the oracle's values on its own new data; what the
    signature leaves open makes a plan of its own: a base off 16-byte alignment (Triton specializes
    pointers on it) and dO's strides."""
    from cuflash.kernels import attention

    looked_up = count_plan_lookups(monkeypatch, attention)

    def step(q, k, v, dout, sdpa=False):
        if sdpa:
            fn = lambda a, b, c: cuflash.scaled_dot_product_attention(  # noqa: E731
                a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
        else:
            fn = lambda a, b, c: cuflash.flash_attn_func(a, b, c, causal=True)  # noqa: E731
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # (in place: a clone would realign q)
        out = fn(*leaves)
        out.backward(dout)
        got = [out.detach()] + [t.grad for t in leaves]
        offset = 0 if sdpa else k.shape[1] - q.shape[1]
        want = run_and_grad(lambda a, b, c: attention_reference(a, b, c, causal=True, causal_offset=offset)[0],
                            q.double(), k.double(), v.double(), dout.double())
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-5
        found = list(looked_up)
        looked_up.clear()
        return found

    def fresh():
        q, k, v = make_qkv(2, 17, 23, 4, 2, 40, torch.float32, "cpu")
        return q, k, v, torch.randn_like(q)

    torch.manual_seed(11)
    assert step(*fresh()) == ["attention_forward", "attention_backward"]
    assert step(*fresh()) == []  # new data: the signature's plans, launched directly
    q, k, v, dout = fresh()
    shifted = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)  # base 4 bytes past 16-byte alignment
    assert step(shifted, k, v, dout) == ["attention_forward", "attention_backward"]
    assert step(shifted, k, v, dout) == []
    strided = torch.randn(2, 4, 17, 40).transpose(1, 2)  # dO at other strides
    assert step(q, k, v, strided) == ["attention_backward"]
    q, k, v, dout = fresh()
    assert step(q[:, :16], k, v, dout[:, :16], sdpa=True) == ["attention_forward", "attention_backward"]
    assert step(q[:, 1:], k, v, dout[:, 1:], sdpa=True) == []


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpret), pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_sdpa_repeats_launch_their_plan_on_its_own_layout(monkeypatch, device):
    """A repeated scaled_dot_product_attention call that records no graph launches its signature's
    kept forward plan on the (B, H, N, D) inputs themselves (ops.forward_kept): no (B, N, H, D) views
    are made, the output is a (B, H, N, D) view of a (B, N, H, D) buffer as before, and new data gets
    the oracle's values. A base off 16-byte alignment has no kept plan yet and goes through the views
    once; inputs requiring grad always do, with autograd."""
    from cuflash import ops
    from cuflash.kernels import attention

    count_plan_lookups(monkeypatch, attention)
    views = []  # the queries of the calls that went through ops.forward, on (B, N, H, D) views
    real_forward = ops.forward
    monkeypatch.setattr(ops, "forward", lambda q, *args: views.append(q) or real_forward(q, *args))

    def call(q, k, v, grad=False):
        views.clear()
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            out = cuflash.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                                enable_gqa=True)
        assert rel_err(out.detach(), want) < 1e-5
        assert out.shape == want.shape and out.transpose(1, 2).is_contiguous()
        if grad:
            dout = torch.randn_like(out)
            out.backward(dout)
            grads = run_and_grad(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                a, b, c, is_causal=True, enable_gqa=True), q.double(), k.double(), v.double(), dout.double())[1:]
            assert all(rel_err(t.grad, g) < 1e-5 for t, g in zip(leaves, grads))
        return len(views) > 0

    def fresh():
        return tuple(torch.randn(2, h, n, 40, device=device) for h, n in ((4, 17), (2, 23), (2, 23)))

    torch.manual_seed(12)
    assert call(*fresh())  # the first call of the signature makes its plan on the views
    assert not call(*fresh()) and not call(*fresh())
    q, k, v = fresh()
    shifted = torch.empty(q.numel() + 1, device=device)[1:].view(q.shape).copy_(q)  # base 4 bytes off 16-byte alignment
    assert call(shifted, k, v) and not call(shifted, k, v)
    assert call(*fresh(), grad=True) and call(*fresh(), grad=True)


@interpret
def test_signature_plans_keep_the_backend_of_their_settings(monkeypatch):
    """A call signature's plans keep the backend that runs it (ops._call_backend), which the
    signature fixes through CUFLASH_BACKEND: switching the variable back and forth on the same
    inputs runs the backend it names every time, each computing the oracle's values."""
    from cuflash import cpu, memo

    monkeypatch.setattr(memo, "CHECKED", {})
    ran = []
    real = cpu.attention_forward
    monkeypatch.setattr(cpu, "attention_forward", lambda *a, **kw: ran.append("cpu") or real(*a, **kw))
    torch.manual_seed(29)
    q, k, v = make_qkv(1, 9, 9, 2, 2, 16, torch.float32, "cpu")
    want, _ = attention_reference(q, k, v, causal=True)
    for choice in ("cpu", "triton", "cpu", "triton"):
        monkeypatch.setenv("CUFLASH_BACKEND", choice)
        for _ in range(2):
            assert rel_err(cuflash.flash_attn_func(q, k, v, causal=True), want) < 1e-5
    assert ran == ["cpu"] * 4


def test_compiled_launcher_calls_the_launcher_as_the_runner_does(monkeypatch):
    """compat.compiled_launcher passes the compiled kernel's launcher what Triton's runner passes it
    (grid, the current device's stream, the kernel's function and metadata, then the arguments), with
    no launch metadata or hooks while the hook chains are empty, and goes through the runner while a
    hook is set (a profiler's)."""
    from triton import knobs

    from cuflash.kernels.compat import compiled_launcher

    calls = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            calls.append(("run", args))

        def __getitem__(self, grid):
            return lambda *args: calls.append(("runner", grid, args))

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 3, raising=False)  # (absent from CPU builds)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    launch = compiled_launcher(Compiled(), (4, 5, 6))
    launch("a", 7)
    assert calls == [("run", (4, 5, 6, 1003, "function", "metadata", None, None, None, "a", 7))]
    calls.clear()

    def hook(metadata):
        pass
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch("a", 7)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls == [("runner", (4, 5, 6), ("a", 7))]


def test_memo_tables_drop_the_oldest_and_stay_bounded_under_threads():
    """The launch plans and the checked call signatures are bounded tables that autograd's backward
    thread and the caller's thread fill at once: dropping the oldest entry must not race (two
    threads dropping the same one raised KeyError)."""
    import sys
    import threading

    from cuflash.memo import remember

    table: dict = {}
    for i in range(5):
        assert remember(table, i, str(i), 3) == str(i)
    assert list(table) == [2, 3, 4]
    errors: list = []

    def fill(thread):
        try:
            for i in range(20000):
                remember(table, (thread, i), i, 8)
        except Exception as e:  # noqa: BLE001 (any error of a thread fails the test)
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between any two bytecodes, as often as possible
    try:
        threads = [threading.Thread(target=fill, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert len(table) <= 8 + 3  # concurrent inserts may each find room for one


@interpret
def test_launch_plan_workspaces_are_fresh_and_made_as_asked():
    """A tensor that a plan's build adds to the launch's tensors is a workspace: every later call of
    the signature gets a new one, not the first call's: zero-filled (the fused backward's dQ sum), or
    uninitialized where build asked for that (kernels that write it whole before reading it)."""
    import triton
    import triton.language as tl

    from cuflash.kernels import launch

    @triton.jit
    def increment(Work, Scratch, Out, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Scratch + offs, offs)
        work = tl.load(Work + offs) + tl.load(Scratch + offs)
        tl.store(Work + offs, work)
        tl.store(Out + offs, work)

    def build(tensors):
        tensors["Work"] = launch.workspace((8,), torch.float32, torch.device("cpu"))
        tensors["Scratch"] = launch.workspace((8,), torch.float32, torch.device("cpu"), zeroed=False)
        return [(increment, (1,), dict(Work=tensors["Work"], Scratch=tensors["Scratch"], Out=tensors["Out"], N=8))]

    firsts = []
    for i in range(6):
        tensors = dict(Out=torch.empty(8))
        plan = launch.launch(("workspace test",), tensors, lambda: build(tensors))
        assert torch.equal(tensors["Out"], torch.arange(8.0)) and torch.equal(tensors["Work"], torch.arange(8.0))
        if i < 3:
            firsts.append(tensors["Work"])
        else:  # poisoned and freed: the allocator hands this memory out again
            tensors["Work"].fill_(float("nan"))
            tensors["Scratch"].fill_(float("nan"))
    assert len({w.data_ptr() for w in firsts}) == 3
    assert {name: zeroed for name, (*_, zeroed) in plan.workspaces.items()} == {"Work": True, "Scratch": False}


@interpret
def test_launch_plan_arguments_are_found_by_identity():
    """A kernel's tensor argument takes its place in the plan by identity among the launch's
    tensors, whatever the name (the unsplit decode writes its result through the arguments that
    name the partial buffers); a tensor that is not one of them (a view made in build) would be
    frozen into the plan and raises, as an int argument the kernel specializes on does."""
    import triton
    import triton.language as tl

    from cuflash.kernels import launch

    @triton.jit(do_not_specialize=["add"])
    def copy_add(Src, Dst, add, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Dst + offs, tl.load(Src + offs) + add)

    @triton.jit
    def copy_add_specialized(Src, Dst, add, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Dst + offs, tl.load(Src + offs) + add)

    for add in (1, 2):  # the second call: the first call's plan, new tensors and int
        tensors = dict(In=torch.arange(8.0), Out=torch.empty(8), add=add)
        launch.launch(("identity test",), tensors, lambda: [
            (copy_add, (1,), dict(Src=tensors["In"], Dst=tensors["Out"], add=tensors["add"], N=8))])
        assert torch.equal(tensors["Out"], torch.arange(8.0) + add)
    tensors = dict(In=torch.arange(16.0), Out=torch.empty(8), add=0)
    with pytest.raises(TypeError, match="Src is not one of the launch's tensors"):
        launch.launch(("view test",), tensors, lambda: [
            (copy_add, (1,), dict(Src=tensors["In"][::2], Dst=tensors["Out"], add=0, N=8))])
    with pytest.raises(TypeError, match="add may change"):
        launch.launch(("specialized test",), tensors, lambda: [
            (copy_add_specialized, (1,), dict(Src=tensors["In"], Dst=tensors["Out"], add=0, N=8))])


def test_launch_plan_tuple_arguments_take_each_calls_tensors():
    """A tuple argument (a mod's captures: tensors and numbers) is made anew on every call of a plan
    with that call's tensors in their places; a tensor in it that is not one of the launch's raises."""
    import triton
    import triton.language as tl

    from cuflash.kernels import launch

    @triton.jit
    def gather_add(Dst, args, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Dst + offs, tl.load(args[0] + offs * args[1]) + args[2])

    for scale in (1.0, 3.0):  # the second call: the first call's plan, new tensors in the tuple
        src = torch.arange(16.0) * scale
        tensors = dict(Out=torch.empty(8), **{"mod 0": src})
        launch.launch(("tuple test",), tensors, lambda: [
            (gather_add, (1,), dict(Dst=tensors["Out"], args=(src, 2, 0.5), N=8))])
        assert torch.equal(tensors["Out"], torch.arange(0.0, 16.0, 2.0) * scale + 0.5)
    with pytest.raises(TypeError, match="args holds a tensor that is not one of the launch's tensors"):
        launch.launch(("tuple view test",), tensors, lambda: [
            (gather_add, (1,), dict(Dst=tensors["Out"], args=(src[::2], 1, 0.5), N=8))])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_launch_plans_on_gpu(head_dim):
    """Calls after a signature's first launch the compiled kernels directly (kernels/launch.py):
    fresh data through the same plans, from the main thread and from another one (descriptor
    kernels need Triton's per-thread scratch allocator set by the plan; D=128 and 256 use
    descriptors at these lengths), must match the oracle every time."""
    import threading

    from cuflash.kernels import launch

    def step(seed):
        torch.manual_seed(seed)
        q, k, v = make_qkv(2, 1100, 1100, 8, 2, head_dim, torch.bfloat16, "cuda")
        check_against_oracle(flash_fn(True), q, k, v, True)
        return True

    step(1)
    plans = len(launch.PLANS)
    step(2)
    done = []
    worker = threading.Thread(target=lambda: done.append(step(3)))
    worker.start()
    worker.join()
    assert done == [True], "the step in another thread failed (its traceback is printed above)"
    assert len(launch.PLANS) == plans  # the later steps reused the first one's plans


@pytest.mark.gpu
def test_inputs_on_a_gpu_other_than_the_current_one():
    """Inputs on cuda:1 while cuda:0 stays current, as in a model split over GPUs in one process
    (transformers' device_map="auto"): the Gluon and Triton kernels, forward and backward, first
    call and the signature's plans after it, match the oracle; a paged decode step, the rotary
    kernel and the teaching methods give what they give with cuda:1 current; cuda:0 stays current."""
    from cuflash import methods
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with torch.cuda.device(0):
        for dtype, seqlen in ((torch.bfloat16, 1100), (torch.float32, 70)):
            torch.manual_seed(seqlen)
            for _ in range(2):
                q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, 64, dtype, "cuda:1")
                check_against_oracle(flash_fn(True), q, k, v, True)

        def decode_step(device_index):
            torch.manual_seed(9)
            q1, k1, v1 = (torch.randn(2, 1, 8, 128, device="cuda:1", dtype=torch.bfloat16) for _ in range(3))
            pages = [torch.randn(16, 16, 8, 128, device="cuda:1", dtype=torch.bfloat16) for _ in range(2)]
            table = torch.randperm(16, device="cuda:1", dtype=torch.int32).view(2, 8)
            seqlens = torch.tensor([100, 37], device="cuda:1", dtype=torch.int32)
            with torch.cuda.device(device_index):
                out = cuflash.flash_attn_with_kvcache(q1, *pages, k1, v1, cache_seqlens=seqlens, block_table=table,
                                                      causal=True)
                x = torch.randn(2, 9, 4, 64, device="cuda:1")
                cos, sin = torch.randn(2, 32, 16, device="cuda:1").unbind(0)
                rotated = cuflash.apply_rotary_emb(x, cos, sin)
                fa1 = methods.forward("fa1", *make_qkv(1, 40, 40, 2, 2, 32, torch.float32, "cuda:1"))[0]
            return out, *pages, rotated, fa1

        for ours, theirs in zip(decode_step(0), decode_step(1)):
            assert torch.equal(ours, theirs)
        assert torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_launch_plans_call_launch_hooks_on_gpu():
    """A profiler's launch hook (Triton's knobs.runtime.launch_enter_hook) sees the launches of a
    signature's plans too (compat.compiled_launcher goes through Triton's runner while one is set),
    and the results stay the oracle's."""
    from triton import knobs
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    torch.manual_seed(2)
    q, k, v = make_qkv(2, 300, 300, 4, 2, 64, torch.bfloat16, "cuda")
    check_against_oracle(flash_fn(True), q, k, v, True)  # the signature's plans made
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        check_against_oracle(flash_fn(True), q, k, v, True)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert any("attn_fwd" in name for name in seen) and any("bwd" in name for name in seen), seen
