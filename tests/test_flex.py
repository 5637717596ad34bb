"""flex_attention and create_block_mask (cuflash.flex) against a float64 oracle that applies each mod
elementwise (the mod itself called on broadcast index tensors, in plain torch, the (B, H, L, S) scores
materialized) and against torch's own flex_attention (eager, CPU: forward only) and create_block_mask."""
import inspect
import math

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import cuflash
from cuflash import ErrorCode, FlashAttentionError

from attn_testing import rel_err, seed_of, strided_view

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated")]

BOUND = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3}
EXACT = {"cpu": torch.float64, "triton": torch.float32}  # the most exact dtype of each backend


def taken(backend: str, dtype: torch.dtype) -> torch.dtype:
    """dtype, where the backend computes in it (the kernels take no float64: those cases skip)."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the kernels take float16, bfloat16 and float32")
    return dtype


# The mods, as a Flex user writes them; factories take what they capture, so that the oracle can
# make them again over float64 copies of captured tensors whose gradient it computes.

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(window):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return mask


def chunked_local(chunk):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)
    return mask


def document(doc_ids):  # (B, L) int
    def mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)
    return mask


def prefix_lm(prefix):  # (B,) int: the keys every query of the sequence sees
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])
    return mask


def alibi(slopes):  # (H,)
    def score(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return score


def softcap(cap):
    def score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score


def relative_bias(table, seqlen_k):  # (H, L + S - 1): a bias per head and distance
    def score(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k - 1]
    return score


def oracle(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """float64 FlexAttention of (B, H, L, E) inputs: (out, lse), rows that see no key 0 and -inf."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, nheads, seqlen_q, head_dim = q.shape
    group = nheads // k.shape[1]
    k, v = (t.repeat_interleave(group, 1) for t in (k, v))
    scores = (head_dim ** -0.5 if scale is None else scale) * q @ k.transpose(-1, -2)
    b, h, q_idx, kv_idx = (torch.arange(n, dtype=torch.int32, device=q.device).view(shape) for n, shape in (
        (batch, (-1, 1, 1, 1)), (nheads, (1, -1, 1, 1)), (seqlen_q, (-1, 1)), (k.shape[2], (1, -1))))
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, q_idx, kv_idx), -math.inf)
    empty = (scores == -math.inf).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return probs @ v, scores.detach().logsumexp(-1)


def inputs(shape_q, shape_k, dtype, *key):
    torch.manual_seed(seed_of(shape_q, shape_k, dtype, *key))
    return torch.randn(shape_q, dtype=dtype), torch.randn(shape_k, dtype=dtype), torch.randn(shape_k, dtype=dtype)


def check(q, k, v, score_mod=None, mask_mod=None, block_size=16, with_torch=True, bound=None, **options):
    """cuflash.flex_attention (with the block mask of mask_mod that cuflash.create_block_mask makes)
    forward and backward against the oracle (to `bound`, by default BOUND's), and on the CPU its
    forward against torch's flex_attention; returns the block mask."""
    batch, nheads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    block_mask = None if mask_mod is None else cuflash.create_block_mask(
        mask_mod, batch, nheads, seqlen_q, seqlen_k, device=q.device, BLOCK_SIZE=block_size)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = cuflash.flex_attention(*leaves, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                      **options)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = oracle(*ref_leaves, score_mod=score_mod, mask_mod=mask_mod, scale=options.get("scale"))
    ref_out.backward(dout.double())
    bound = bound or BOUND[q.dtype]
    for name, ours, ref in (("out", out, ref_out), *zip(("dq", "dk", "dv"), (t.grad for t in leaves),
                                                         (t.grad for t in ref_leaves))):
        assert rel_err(ours, ref) < bound, f"{name}: error {rel_err(ours, ref):.3g}"
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()), "the rows that see no key"
    seen = ~ref_lse.isneginf()
    assert rel_err(lse[seen], ref_lse[seen]) < bound
    if with_torch and q.dtype in (torch.float32, torch.float64) and q.device.type == "cpu":
        theirs_mask = None if mask_mod is None else torch_flex.create_block_mask(
            mask_mod, batch, nheads, seqlen_q, seqlen_k, device="cpu", BLOCK_SIZE=block_size)
        theirs, their_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=theirs_mask,
                                                      return_lse=True, **options)
        assert rel_err(out.detach(), theirs) < bound
        assert torch.equal(lse.isneginf(), their_lse.isneginf())
        assert rel_err(lse[seen], their_lse[seen]) < bound
    return block_mask


MASKS = {"causal": lambda B, L: causal, "sliding_window": lambda B, L: sliding_window(7),
         "chunked_local": lambda B, L: chunked_local(10),
         "document": lambda B, L: document(torch.randint(0, 3, (B, L)).sort(-1).values),
         "prefix_lm": lambda B, L: prefix_lm(torch.tensor([L // 3, 5])[:B])}


@pytest.mark.parametrize("seqlen", [1, 17, 100])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("mask", MASKS)
def test_mask_mods(backend, mask, block_size, seqlen):
    """The masks people use, through a block mask whose last blocks are ragged."""
    q, k, v = inputs((2, 3, seqlen, 16), (2, 3, seqlen, 16), EXACT[backend], mask, block_size)
    check(q, k, v, mask_mod=MASKS[mask](2, seqlen), block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("mod", ["alibi", "softcap", "relative_bias"])
def test_score_mods(backend, mod, dtype):
    q, k, v = inputs((2, 4, 37, 16), (2, 4, 45, 16), taken(backend, dtype), mod)
    score_mod = {"alibi": alibi(torch.rand(4) / 4), "softcap": softcap(0.7),
                 "relative_bias": relative_bias(torch.randn(4, 37 + 45 - 1), 45)}[mod]
    check(q, k, v, score_mod=score_mod, with_torch=dtype != torch.float16)


def test_score_mod_with_mask_gqa_and_scale(backend):
    """A score_mod and a block mask together, grouped-query heads (h the query head) and a scale."""
    q, k, v = inputs((2, 6, 50, 8), (2, 2, 50, 8), EXACT[backend])
    check(q, k, v, score_mod=alibi(torch.linspace(0.1, 0.6, 6)), mask_mod=sliding_window(9), enable_gqa=True,
          scale=0.3)


def test_rows_that_see_no_key(backend):
    """Queries whose every key is hidden (whole blocks skipped, and partly hidden blocks) give 0 and an
    lse of -inf, gradients 0."""
    def mask(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 0) & (kv_idx <= q_idx) & (q_idx < 40)
    q, k, v = inputs((1, 2, 50, 16), (1, 2, 50, 16), EXACT[backend])
    check(q, k, v, mask_mod=mask)


def late_rows(first):
    def mask(b, h, q_idx, kv_idx):  # the rows before `first` see no key: their blocks list none
        return (q_idx >= first) & (kv_idx <= q_idx)
    return mask


# On the GPU: the Hopper (Gluon) forward where it runs (16-bit, head dims 64, 128 and 256; a block mask's
# query blocks a multiple of 128 rows), the Triton backward; ragged ends, seqlen_q != seqlen_k, GQA.
GPU_CASES = [  # (score_mod, mask_mod, head_dim, (seqlen_q, seqlen_k), BLOCK_SIZE)
    (None, "causal", 128, (1000, 1000), 128),
    ("alibi", "sliding_window", 64, (777, 1000), 128),
    (None, "document", 128, (1000, 1000), (256, 64)),
    ("relative_bias", "prefix_lm", 256, (1000, 777), 128),
    ("softcap", None, 256, (300, 777), 128),
    ("alibi", None, 128, (777, 300), 128),
    (None, "chunked_local", 64, (1000, 1000), (128, 256)),
    ("softcap", "late_rows", 128, (1000, 1000), 128),
    ("relative_bias", "causal", 128, (1000, 1000), 64),  # (query blocks of 64: the Triton forward)
]
GPU_BOUND = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_flex_on_gpu(case, dtype):
    score, mask, head_dim, (seqlen_q, seqlen_k), block_size = case
    torch.manual_seed(seqlen_q + head_dim)
    q = torch.randn(2, 8, seqlen_q, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, seqlen_k, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    length = max(seqlen_q, seqlen_k)
    score_mod = {None: None, "alibi": alibi(torch.rand(8, device="cuda") / 32), "softcap": softcap(2.0),
                 "relative_bias": relative_bias(torch.randn(8, seqlen_q + seqlen_k - 1, device="cuda"),
                                                seqlen_k)}[score]
    mask_mod = {None: None, "causal": causal, "sliding_window": sliding_window(200),
                "chunked_local": chunked_local(300),
                "document": document(torch.randint(0, 5, (2, length), device="cuda").sort(-1).values),
                "prefix_lm": prefix_lm(torch.tensor([length // 3, 100], device="cuda")),
                "late_rows": late_rows(300)}[mask]
    check(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_size=block_size, enable_gqa=True,
          bound=GPU_BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mod", ["shift", "tanh_of_indices", "tanh_of_a_16bit_table"])
def test_hopper_mod_edges_on_gpu(mod, dtype):
    """Query blocks longer than the queries (a 128-row block over 50 rows lists a 64-row tile past every
    query, whose rows must pass no probability: exp(12) overflows fp16), and tanh of operands that are
    not fp32 (an integer expression, a 16-bit captured table) on the GPU's fast tanh."""
    torch.manual_seed(3)
    q = torch.randn(2, 4, 50, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 4, 128, 128, device="cuda", dtype=dtype) for _ in range(2))
    table = torch.randn(4, device="cuda", dtype=dtype)
    score_mod = {"shift": lambda score, b, h, q_idx, kv_idx: score + 12.0,
                 "tanh_of_indices": lambda score, b, h, q_idx, kv_idx: score + torch.tanh(q_idx - kv_idx),
                 "tanh_of_a_16bit_table": lambda score, b, h, q_idx, kv_idx: score + torch.tanh(table[h])}[mod]
    check(q, k, v, score_mod=score_mod, mask_mod=causal, block_size=128, bound=GPU_BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_learnable_bias_on_gpu(mask, head_dim, dtype):
    """A learnable relative-position bias through the Hopper kernels (the dK/dV kernel adds its gradient),
    with grouped-query heads and ragged lengths, against the oracle's gradients."""
    torch.manual_seed(head_dim)
    seqlen_q, seqlen_k = 1000, 777
    q = torch.randn(2, 8, seqlen_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, seqlen_k, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    table = torch.randn(8, seqlen_q + seqlen_k - 1, device="cuda", requires_grad=True)
    block_mask = None if mask is None else cuflash.create_block_mask(causal, 2, 8, seqlen_q, seqlen_k)
    out = cuflash.flex_attention(q, k, v, relative_bias(table, seqlen_k), block_mask, enable_gqa=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    ref, _ = oracle(*refs[:3], relative_bias(refs[3], seqlen_k), None if mask is None else causal)
    ref.backward(dout.double())
    for name, ours, theirs in (("out", out, ref), *zip(("dq", "dk", "dv", "table"), (q.grad, k.grad, v.grad,
                                                                                     table.grad),
                                                        (t.grad for t in refs))):
        assert rel_err(ours.detach(), theirs) < GPU_BOUND[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("qkv_grad", [False, True])
@pytest.mark.parametrize("captured", ["bias_table", "alibi_slopes"])
def test_captured_tensor_gradient(backend, captured, qkv_grad, dtype):
    """A learnable relative-position bias table, or learnable ALiBi slopes, gets the oracle's gradient,
    with or without q, k and v requiring theirs; through a block mask and grouped-query heads."""
    q, k, v = inputs((2, 4, 33, 16), (2, 2, 41, 16), taken(backend, dtype), captured)
    if captured == "bias_table":
        tensor, make = torch.randn(4, 33 + 41 - 1, dtype=dtype), lambda t: relative_bias(t, 41)
    else:
        tensor, make = torch.rand(4, dtype=dtype) / 4, alibi
    tensor.requires_grad_()
    block_mask = cuflash.create_block_mask(chunked_local(12), None, 4, 33, 41, device="cpu", BLOCK_SIZE=16)
    dout = torch.randn(2, 4, 33, 16, dtype=dtype)
    leaves = [t.requires_grad_(qkv_grad) for t in (q, k, v)]
    out = cuflash.flex_attention(*leaves, make(tensor), block_mask, enable_gqa=True)
    out.backward(dout)
    ref_tensor = tensor.detach().double().requires_grad_()
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = oracle(*ref_leaves, make(ref_tensor), chunked_local(12))
    ref.backward(dout.double())
    assert rel_err(out.detach(), ref) < BOUND[dtype]
    assert tensor.grad.dtype == dtype and rel_err(tensor.grad, ref_tensor.grad) < BOUND[dtype]
    for ours, theirs in zip(leaves, ref_leaves):
        assert ours.grad is None if not qkv_grad else rel_err(ours.grad, theirs.grad) < BOUND[dtype]


def test_strided_inputs(backend):
    """Transposed views of (B, L, H, E) buffers, and a head dim of stride 2 (copied once)."""
    q, k, v = inputs((2, 17, 3, 16), (2, 23, 3, 16), EXACT[backend])
    views = [t.transpose(1, 2) for t in (q, k, strided_view(v))]
    assert views[2].stride(-1) == 2
    check(*views, score_mod=softcap(2.0), mask_mod=prefix_lm(torch.tensor([4, 9])))


def test_block_mask_lists_rule(backend):
    """FlexAttention's kernels' reading of a BlockMask made by hand: blocks listed as full are seen
    whole (their mask_mod is not applied), those listed as partial through mask_mod, the others not at
    all; a per-head list (H = 2) and batch broadcast (B = 1). (torch's eager flex_attention applies
    mask_mod everywhere and reads no lists: the same only for lists that create_block_mask makes.)"""
    kv_num = torch.tensor([[[1, 1, 2], [2, 0, 1]]], dtype=torch.int32)  # (1, H=2, 3 query blocks)
    kv_idx = torch.tensor([[[[0, 1, 2], [1, 0, 2], [1, 2, 0]], [[0, 2, 1], [0, 1, 2], [2, 0, 1]]]], dtype=torch.int32)
    full_num = torch.tensor([[[0, 1, 1], [1, 1, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 1, 2], [0, 1, 2], [0, 1, 2]], [[1, 0, 2], [2, 0, 1], [0, 1, 2]]]],
                            dtype=torch.int32)
    block_mask = torch_flex.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=16,
                                                     mask_mod=causal, seq_lengths=(40, 44))
    # The state of each (head, query block, key block): 0 hidden, 1 partial, 2 full.
    states = torch.zeros(2, 3, 3, dtype=torch.long)
    for h in range(2):
        for i in range(3):
            states[h, i, kv_idx[0, h, i, :kv_num[0, h, i]].long()] = 1
            states[h, i, full_idx[0, h, i, :full_num[0, h, i]].long()] = 2

    def element_mask(b, h, q_idx, kv_idx):
        state = states[h, q_idx // 16, kv_idx // 16]
        return (state == 2) | ((state == 1) & causal(b, h, q_idx, kv_idx))
    q, k, v = inputs((2, 2, 40, 8), (2, 2, 44, 8), EXACT[backend])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = cuflash.flex_attention(*leaves, block_mask=block_mask)
    out.sum().backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = oracle(*ref_leaves, mask_mod=element_mask)
    ref.sum().backward()
    assert rel_err(out.detach(), ref) < BOUND[q.dtype]
    for ours, theirs in zip(leaves, ref_leaves):
        assert rel_err(ours.grad, theirs.grad) < BOUND[q.dtype]


def test_lse_and_aux(backend):
    q, k, v = inputs((1, 2, 30, 8), (1, 2, 30, 8), torch.float32)
    block_mask = cuflash.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 10, None, None, 30, 30, device="cpu")
    out, lse = cuflash.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    assert lse.shape == (1, 2, 30) and lse.dtype == torch.float32
    assert lse[..., :10].isneginf().all() and lse[..., 10:].isfinite().all() and not out[:, :, :10].any()
    if hasattr(torch_flex, "AuxRequest"):
        out2, aux = cuflash.flex_attention(q, k, v, block_mask=block_mask, return_aux=torch_flex.AuxRequest(lse=True))
        assert isinstance(aux, torch_flex.AuxOutput) and aux.max_scores is None
        assert torch.equal(aux.lse, lse) and torch.equal(out2, out)
        _, aux = cuflash.flex_attention(q, k, v, return_aux=torch_flex.AuxRequest())
        assert aux.lse is None
    plain = cuflash.flex_attention(q, k, v, kernel_options={})
    assert rel_err(plain, oracle(q, k, v)[0]) < 1e-5


@pytest.mark.parametrize("only_lse", [False, True])
def test_lse_gradient(backend, only_lse):
    """The lse is differentiable, as torch's flex_attention's: a loss on out and lse (or on lse alone) gets
    the oracle's gradients, through a score_mod, a block mask and grouped-query heads; rows that see no key
    (lse -inf) pass no gradient."""
    q, k, v = inputs((2, 4, 33, 16), (2, 2, 41, 16), EXACT[backend], only_lse)
    block_mask = cuflash.create_block_mask(late_rows(5), None, None, 33, 41, device="cpu", BLOCK_SIZE=16)
    score_mod = alibi(torch.rand(4) / 4)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = cuflash.flex_attention(*leaves, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                      enable_gqa=True)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    seen = ~lse.isneginf()
    loss = (lse[seen] * g_lse[seen]).sum() + (0 if only_lse else (out * g_out).sum())
    loss.backward()
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle(*refs, score_mod=score_mod, mask_mod=late_rows(5))
    kd = refs[1].repeat_interleave(2, 1)
    scores = score_mod(refs[0] @ kd.transpose(-1, -2) * 16 ** -0.5,
                       *(torch.arange(n, dtype=torch.int32).view(shape) for n, shape in (
                           (2, (-1, 1, 1, 1)), (4, (1, -1, 1, 1)), (33, (-1, 1)), (41, (1, -1)))))
    visible = late_rows(5)(0, 0, torch.arange(33)[:, None], torch.arange(41)[None, :])
    ref_lse = scores.masked_fill(~visible, -math.inf)[..., 5:, :].logsumexp(-1)  # (rows 5 on see keys)
    ref_loss = (ref_lse * g_lse[..., 5:].double()).sum() + (0 if only_lse else (ref_out * g_out.double()).sum())
    ref_loss.backward()
    assert torch.equal(seen[..., 5:], torch.ones_like(seen[..., 5:])) and not seen[..., :5].any()
    for name, ours, theirs in zip(("dq", "dk", "dv"), leaves, refs):
        if theirs.grad is None:  # (the lse does not depend on v)
            assert name == "dv" and only_lse and not ours.grad.any()
        else:
            assert rel_err(ours.grad, theirs.grad) < BOUND[q.dtype], name


# create_block_mask: torch's lists, without torch.compile.

LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
         "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("lengths", [(1, 1), (17, 17), (100, 100), (64, 64), (33, 90), (90, 33)])
@pytest.mark.parametrize("block_size", [16, 32, (16, 32)])
@pytest.mark.parametrize("mask", MASKS)
def test_create_block_mask_matches_torch(mask, block_size, lengths):
    """The same lists as torch's create_block_mask (the ragged last blocks too), tables per batch where
    the mask reads b (document, prefix-LM), broadcast (B = None) where it does not."""
    seqlen_q, seqlen_k = lengths
    mask_mod = MASKS[mask](2, max(lengths))
    batch = 2 if mask in ("document", "prefix_lm") else None
    ours = cuflash.create_block_mask(mask_mod, batch, None, seqlen_q, seqlen_k, device="cpu", BLOCK_SIZE=block_size)
    theirs = torch_flex.create_block_mask(mask_mod, batch, None, seqlen_q, seqlen_k, device="cpu",
                                          BLOCK_SIZE=block_size)
    assert type(ours) is torch_flex.BlockMask
    assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    assert ours.mask_mod is mask_mod
    for name in LISTS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), name


def test_create_block_mask_heads_chunks_and_options(monkeypatch):
    """A mask that reads h, computed a few blocks at a time (a small MASK_CHUNK), with
    separate_full_blocks=False: torch's lists."""
    import cuflash.flex
    monkeypatch.setattr(cuflash.flex, "MASK_CHUNK", 600)

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 8 * h
    for separate in (True, False):
        ours = cuflash.create_block_mask(per_head, 2, 3, 70, 50, device="cpu", BLOCK_SIZE=(8, 16),
                                         separate_full_blocks=separate)
        theirs = torch_flex.create_block_mask(per_head, 2, 3, 70, 50, device="cpu", BLOCK_SIZE=(8, 16),
                                              separate_full_blocks=separate)
        for name in LISTS:
            a, b = getattr(ours, name), getattr(theirs, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


def test_signatures_match_torch():
    ours = inspect.signature(cuflash.flex_attention).parameters
    theirs = inspect.signature(torch_flex.flex_attention).parameters
    assert [(p.name, p.default, p.kind) for p in ours.values()] == \
        [(p.name, p.default, p.kind) for p in theirs.values()]
    ours = [(p.name, p.default) for p in inspect.signature(cuflash.create_block_mask).parameters.values()]
    theirs = [(p.name, p.default) for p in inspect.signature(torch_flex.create_block_mask).parameters.values()]
    assert ours == theirs[:len(ours)] and len(ours) == 9


# Errors: FlashAttentionError naming what is wrong, before any attention runs.

def test_bad_mods():
    q = torch.randn(1, 2, 8, 16)

    def unsupported(score, b, h, q_idx, kv_idx):
        return torch.erf(score)

    def branches(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else -score

    def int_score(score, b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def int_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx
    for fn, what in ((unsupported, "calls erf"), (branches, "Python control flow"), (int_score, "floating-point")):
        with pytest.raises(FlashAttentionError, match=f"score_mod .*{fn.__name__}.*{what}") as error:
            cuflash.flex_attention(q, q, q, score_mod=fn)
        assert error.value.code == ErrorCode.UNSUPPORTED_FEATURE
    with pytest.raises(FlashAttentionError, match="mask_mod .*int_mask.* returns .*a mask_mod returns a bool"):
        cuflash.create_block_mask(int_mask, 1, 1, 8, 8, device="cpu")
    block_mask = torch_flex.BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32),
                                                     torch.zeros(1, 1, 1, 1, dtype=torch.int32), BLOCK_SIZE=8,
                                                     mask_mod=int_mask, seq_lengths=(8, 8))
    with pytest.raises(FlashAttentionError, match="mask_mod .*int_mask"):
        cuflash.flex_attention(q, q, q, block_mask=block_mask)


def test_bad_arguments():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    cases = [
        (dict(block_mask=cuflash.create_block_mask(causal, 1, 1, 8, 8, device="cpu")), "block_mask was made for"),
        (dict(block_mask=torch.ones(8, 12, dtype=torch.bool)), "block_mask must be"),
        (dict(kernel_options={"BLOCK_M": 64}), "kernel_options .*BLOCK_M.*tunes"),
        (dict(kernel_options=[("BLOCK_M", 64)]), "kernel_options must be"),
        (dict(enable_gqa=1), "enable_gqa must be a bool"),
        (dict(score_mod=alibi(torch.zeros(2, device="meta"))), "captures a tensor on meta"),
        (dict(return_lse=True, return_aux=getattr(torch_flex, "AuxRequest", tuple)()), "not both|return_aux"),
    ]
    if hasattr(torch_flex, "AuxRequest"):
        cases.append((dict(return_aux=torch_flex.AuxRequest(max_scores=True)), "max_scores"))
    for options, message in cases:
        with pytest.raises(FlashAttentionError, match=message):
            cuflash.flex_attention(q, k, v, **options)
    assert cuflash.flex_attention(q, k, v[..., :8]).shape[-1] == 8  # (v's head dim apart: taken, as torch)
    with pytest.raises(FlashAttentionError, match="query has 2 heads and key 1; pass enable_gqa=True"):
        cuflash.flex_attention(q, k[:, :1], v[:, :1])
    bad_lists = cuflash.create_block_mask(causal, 1, 1, 8, 12, device="cpu")
    bad_lists.kv_indices.fill_(3)
    with pytest.raises(FlashAttentionError, match="list blocks outside the 1 blocks"):
        cuflash.flex_attention(q, k, v, block_mask=bad_lists)
    for args, message in (((causal, 0, None, 8, 8), "B must be an int >= 1 or None"),
                          ((causal, None, None, 8, 8.0), "KV_LEN must be an int >= 1, got 8.0"),
                          ((causal, None, None, 8, 8, "cpu", (16, 0)), "BLOCK_SIZE must be")):
        with pytest.raises(FlashAttentionError, match=message):
            cuflash.create_block_mask(*args)


def test_mods_refused_under_torch_func():
    """The custom ops have no functorch rules: a transform that goes through them with mods says so
    (without mods torch raises its own error there)."""
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(FlashAttentionError, match="not supported under torch.func transforms"):
        torch.func.grad(lambda x: cuflash.flex_attention(x, q, q, score_mod=softcap(3.0)).sum())(q)
    with pytest.raises(FlashAttentionError, match="not supported under torch.func transforms"):
        torch.func.vmap(lambda x: cuflash.flex_attention(x, q, q, score_mod=softcap(3.0)))(q[None])


def test_a_block_masks_lists_are_kept_until_changed(backend):
    """The checked lists of a BlockMask are made once and kept with it; an in-place change to one of
    its tensors (here: every query block made to see no key) is seen by the next call."""
    q, k, v = inputs((1, 2, 32, 16), (1, 2, 32, 16), EXACT[backend])
    block_mask = cuflash.create_block_mask(causal, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    first = cuflash.flex_attention(q, k, v, block_mask=block_mask)
    assert torch.equal(cuflash.flex_attention(q, k, v, block_mask=block_mask), first)
    block_mask.kv_num_blocks.zero_()
    block_mask.full_kv_num_blocks.zero_()
    assert first.abs().sum() > 0 and torch.equal(cuflash.flex_attention(q, k, v, block_mask=block_mask),
                                                 torch.zeros_like(first))


@pytest.mark.parametrize("seqlen", [100, 1000])
def test_block_lists_strides_are_multiples_of_16(seqlen):
    """The lists the kernels read have strides that are multiples of 16 whatever the number of blocks:
    Triton compiles a kernel per class of an int argument, and strides following the length would make
    new kernels for lengths a block apart."""
    from cuflash.flex import block_sparsity
    block_mask = cuflash.create_block_mask(causal, None, None, seqlen, seqlen, device="cpu", BLOCK_SIZE=16)
    lists = block_sparsity(block_mask, 2, 3)
    for name in ("kv_num", "kv_idx", "full_kv_num", "full_kv_idx", "q_num", "q_idx", "full_q_num", "full_q_idx"):
        t = getattr(lists, name)
        assert all(s % 16 == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1, (name, t.stride())
