"""train/grouped_topk.grouped_topk: the selector candidates' top-k, found among the row's best groups, is torch.topk's;
its Triton kernel (train/grouped_topk_triton.py) is held to torch.topk in the interpreter."""

import textwrap

import pytest
import torch

from dflashkit.train import grouped_topk as grouped_topk_module
from dflashkit.train.grouped_topk import TOPK_GROUP, grouped_topk, grouped_topk_reference, topk_kernel_runs
from dflashkit.train.loss import LossSettings, block_loss, logit_statistics

from support.triton_interpreter import INTERPRETER_PREAMBLE, run_in_interpreter

row_stats, grouped_stats = logit_statistics(False, False), logit_statistics(True, False)  # eager


def check(x: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = grouped_topk(x, k, group)
    ref = torch.topk(x, k, dim=-1)
    assert torch.equal(values, ref.values)  # the same values, largest first
    assert torch.equal(x.gather(1, ids), values)  # the ids point at them
    assert all(len(set(row)) == k for row in ids.tolist())  # k distinct columns a row
    return values, ids


@pytest.mark.parametrize("cols", [4096, 4096 + 77])  # a multiple of the group, and a tail
def test_distinct_logits_give_torch_topk_values_and_ids(cols):
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(0))
    _, ids = check(x, 16, 32)
    assert torch.equal(ids, torch.topk(x, 16, dim=-1).indices)  # no ties: the same ids too


def test_the_top_values_crowded_in_one_group_or_in_the_tail():
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))  # 31 groups of 32 and a tail of 8
    x[0, 64:68] += 100.0  # all 4 in one group
    x[1, 995:1000] += 100.0  # the 4 largest in the tail past the last whole group
    x[2, ::32] += 100.0  # one in each group and in the tail: the group maxima all close
    check(x, 4, 32)


def test_ties_keep_the_values_and_distinct_ids():
    """bf16 logits of a few distinct values: many ties inside and across groups."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (32, 2048), generator=g).to(torch.bfloat16)
    check(x, 16, 16)


def test_short_rows_use_torch_topk_whole():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    values, ids = grouped_topk(x, 16, 32)  # 9 groups < 4k: the whole row
    ref = torch.topk(x, 16, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(ids, ref.indices)


def test_the_loss_pass_candidates_over_a_grouped_vocabulary():
    """block_loss(top_k) on a vocabulary of whole groups and a tail: the candidates are the logits' top_k."""
    g = torch.Generator().manual_seed(4)
    vocab = 16 * TOPK_GROUP + 40
    hidden, weight = torch.randn(6, 3, 8, generator=g), torch.randn(vocab, 8, generator=g)
    labels, valid = torch.randint(0, vocab, (6, 3), generator=g), torch.ones(6, 3, dtype=torch.bool)
    out = block_loss(hidden, weight, labels, valid, LossSettings(chunk_tokens=9), top_k=4)
    top = torch.topk(hidden @ weight.T, 4, dim=-1)
    torch.testing.assert_close(out.top_logits, top.values)
    assert torch.equal(out.top_ids, top.indices)


@pytest.mark.parametrize("cols", [1024, 1024 + 45])  # whole groups, and a tail past the last one
def test_grouped_statistics_are_the_row_statistics_and_the_group_maxima(cols):
    """One read gives logsumexp, the label's logit, the argmax and grouped_topk's group maxima."""
    g = torch.Generator().manual_seed(5)
    x = (4 * torch.randn(40, cols, generator=g)).to(torch.bfloat16)
    x[0, -1] = 30.0  # the row's maximum in the tail (or the last group)
    x[1, 3] = 30.0  # in the first group
    labels = torch.randint(0, cols, (40,), generator=g)
    lse, tgt, arg, gmax = grouped_stats(x, labels, torch.float32, 32)
    ref_lse, ref_tgt, ref_arg = row_stats(x, labels, torch.float32)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    assert torch.equal(tgt, ref_tgt) and torch.equal(arg, ref_arg)
    assert torch.equal(gmax, x[:, : cols // 32 * 32].view(40, -1, 32).amax(-1).float())
    values, ids = grouped_topk(x, 8, 32, group_max=gmax)
    assert torch.equal(values, torch.topk(x, 8, dim=-1).values) and torch.equal(x.gather(1, ids), values)


def test_grouped_statistics_break_ties_as_argmax():
    """Equal maxima in several groups and in the tail: the first column holding the maximum, as torch.argmax."""
    x = torch.zeros(4, 100)
    x[0, [5, 40, 99]] = 1.0  # first group, a later group, the tail
    x[1, [70, 98]] = 1.0  # a group and the tail
    x[2, 97] = 1.0  # the tail alone
    lse, _, arg, _ = grouped_stats(x, torch.zeros(4, dtype=torch.long), torch.float32, 32)
    assert arg.tolist() == [5, 70, 97, 0] == torch.argmax(x, -1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))


@pytest.mark.parametrize("variant", ["ce", "dpace"])
def test_candidates_leave_the_loss_and_gradient_unchanged(variant):
    """block_loss with top_k (the grouped statistics) gives the loss, metrics and gradient of block_loss without."""
    g = torch.Generator().manual_seed(6)
    vocab = 16 * TOPK_GROUP + 40
    weight = torch.randn(vocab, 8, generator=g)
    labels, valid = torch.randint(0, vocab, (6, 3), generator=g), torch.rand(6, 3, generator=g) > 0.2
    outs, grads = [], []
    for top_k in (0, 4):
        hidden = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(7)).requires_grad_()
        out = block_loss(hidden, weight, labels, valid, LossSettings(variant=variant, chunk_tokens=9), top_k=top_k)
        out.loss_sum.backward()
        outs.append(out)
        grads.append(hidden.grad)
    for name in ("loss_sum", "ce_sum", "correct", "counted", "tau_sum", "runs"):
        torch.testing.assert_close(getattr(outs[1], name), getattr(outs[0], name), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_given_group_maxima_are_used_instead_of_read_again():
    """grouped_topk picks its groups from ``group_max`` when given: maxima that name other groups give other
    candidates (a version reading the logits again would still return torch.topk's)."""
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(8))
    true_max = x.view(4, 32, 32).amax(-1)
    assert torch.equal(grouped_topk(x, 4, 32, group_max=true_max)[0], torch.topk(x, 4, dim=-1).values)
    wrong = -true_max  # the groups with the smallest maxima
    assert not torch.equal(grouped_topk(x, 4, 32, group_max=wrong)[0], torch.topk(x, 4, dim=-1).values)


def topk_before_out(x, k, group, group_max):
    """grouped_topk as it was before it wrote into given buffers (issue 36): the reference of the two tests below."""
    rows, cols = x.shape
    body = cols // group * group
    grouped = x[:, :body].view(rows, -1, group)
    best = torch.topk(group_max, k, dim=-1).indices
    cand = grouped.gather(1, best.unsqueeze(-1).expand(rows, k, group)).view(rows, k * group)
    if body < cols:
        cand = torch.cat([cand, x[:, body:]], dim=-1)
    values, at = torch.topk(cand, k, dim=-1)
    ids = best.gather(1, (at // group).clamp(max=k - 1)) * group + at % group
    return values, torch.where(at < k * group, ids, at - k * group + body)


@pytest.mark.parametrize("cols", [2048, 2048 + 45])  # whole groups, and a tail
def test_written_into_buffers_the_candidates_are_the_earlier_ones(cols):
    """grouped_topk(out=...) and without: bit for bit the values and ids of the earlier form, ties included."""
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-6, 7, (48, cols), generator=g).to(torch.bfloat16)  # many equal logits
    gmax = x[:, : cols // 32 * 32].view(48, -1, 32).amax(-1).float()
    ref = topk_before_out(x, 16, 32, gmax)
    buffers = (torch.empty(96, 16, dtype=torch.bfloat16), torch.empty(96, 16, dtype=torch.long))
    out = (buffers[0][48:], buffers[1][48:])
    for got in (grouped_topk(x, 16, 32, group_max=gmax), grouped_topk(x, 16, 32, group_max=gmax, out=out), out):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("extra", [0, 40])  # a vocabulary of whole groups, and a tail
def test_the_loss_pass_candidates_of_a_bf16_head_are_the_earlier_ones(extra):
    """block_loss(top_k) with a bf16 lm_head: per chunk the earlier grouped top_k, its values upcast to float32,
    bit for bit (the buffers are now written in place and upcast once)."""
    g = torch.Generator().manual_seed(10)
    vocab, k, p = 16 * TOPK_GROUP + extra, 4, 3
    hidden, weight = torch.randn(7, p, 8, generator=g), torch.randn(vocab, 8, generator=g).bfloat16()
    labels, valid = torch.randint(0, vocab, (7, p), generator=g), torch.ones(7, p, dtype=torch.bool)
    out = block_loss(hidden, weight, labels, valid, LossSettings(chunk_tokens=9), top_k=k)  # chunks of 3 blocks
    values, ids = [], []
    for s in range(0, 7, 3):
        raw = torch.nn.functional.linear(hidden[s:s + 3].reshape(-1, 8).bfloat16(), weight)
        gmax = grouped_stats(raw, labels[s:s + 3].reshape(-1), torch.float32, TOPK_GROUP)[3]
        v, i = topk_before_out(raw, k, TOPK_GROUP, gmax)
        values.append(v.float())
        ids.append(i)
    assert out.top_logits.dtype == torch.float32 and out.top_logits.shape == (7, p, k)
    assert torch.equal(out.top_logits, torch.cat(values).view(7, p, k))
    assert torch.equal(out.top_ids, torch.cat(ids).view(7, p, k))


# --------------------------------------------------------------------------- the Triton kernel and its dispatch
def test_the_cpu_path_is_the_torch_twin(monkeypatch):
    """Without the interpreter the CPU never takes the kernel: grouped_topk is grouped_topk_reference, ties too."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randint(-3, 4, (32, 64 * 16), generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    assert not topk_kernel_runs(x, 16, 16)
    values, ids = grouped_topk(x, 16, 16)
    ref = grouped_topk_reference(x, 16, 16)
    assert torch.equal(values, ref[0]) and torch.equal(ids, ref[1])
    assert torch.equal(values, torch.topk(x, 16, dim=-1).values)


def test_the_kernel_is_chosen_only_where_it_fits(monkeypatch):
    """Where Triton runs, the kernel takes fp32/bf16/fp16 rows of whole power-of-two groups with unit column
    stride (a row stride is fine); a tail, fp64, short rows, other groups and strided columns stay on torch."""
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.setattr(grouped_topk_module, "triton_available", lambda device: True)
    x = torch.randn(4, 64 * 16)
    for fits in (x, x.bfloat16(), x.half(), torch.randn(4, 64 * 16 + 9)[:, 9:]):
        assert topk_kernel_runs(fits, 16, 16)
    assert not topk_kernel_runs(torch.randn(4, 64 * 16 + 5), 16, 16)  # a tail past the last whole group
    assert not topk_kernel_runs(x.double(), 16, 16)  # fp64: float32 comparisons would not be exact
    assert not topk_kernel_runs(x, 32, 16)  # 64 groups < 4k: torch.topk over the row
    assert not topk_kernel_runs(torch.randn(4, 64 * 24), 16, 24)  # a group that is no power of two
    assert not topk_kernel_runs(torch.randn(64 * 16, 4).t(), 16, 16)  # columns not contiguous
    monkeypatch.setattr(grouped_topk_module, "triton_available", lambda device: False)
    assert not topk_kernel_runs(x, 16, 16)


# the kernel's launches counted in ``launches`` (grouped_topk imports the launcher at each call)
COUNT_LAUNCHES = textwrap.dedent("""
    import dflashkit.train.grouped_topk_triton as kernel
    launches = []
    launch = kernel.grouped_topk_triton
    def counted(*args, **kwargs):
        launches.append(1)
        return launch(*args, **kwargs)
    kernel.grouped_topk_triton = counted
""")

KERNEL_SCRIPT = INTERPRETER_PREAMBLE + COUNT_LAUNCHES + textwrap.dedent("""
    from dflashkit.train.grouped_topk import grouped_topk
    from dflashkit.train.loss import logit_statistics
    results = {}
    def check(name, x, k, group, group_max=None, out=None):
        # [kernel launches, values are torch.topk's, ids point at them, distinct, lowest column on ties, in out]
        before = len(launches)
        values, ids = grouped_topk(x, k, group, group_max=group_max, out=out)
        lowest = torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[:, :k]
        in_out = out is None or (values.data_ptr(), ids.data_ptr()) == (out[0].data_ptr(), out[1].data_ptr())
        results[name] = [len(launches) - before, torch.equal(values, torch.topk(x, k, dim=-1).values),
                         torch.equal(x.gather(1, ids), values), all(len(set(r)) == k for r in ids.tolist()),
                         torch.equal(ids, lowest), in_out]
    g = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, group, n_groups, k in ((8, 16, 64, 16), (32, 32, 16, 4), (4, 256, 64, 16)):
            x = (3 * torch.randn(rows, n_groups * group, generator=g)).to(dtype)
            check(f"random {dtype} group {group} k {k}", x, k, group)
    # many ties: a few distinct values, inside groups and across them
    check("ties bf16", torch.randint(-3, 4, (16, 64 * 16), generator=g).to(torch.bfloat16), 16, 16)
    check("ties fp32", torch.randn(24, 16 * 32, generator=g).round(), 4, 32)
    check("ties over several groups", torch.randint(0, 2, (8, 128 * 16), generator=g).float(), 32, 16)  # k > group
    x = torch.full((4, 64 * 16), float("-inf"))
    x[0, 5] = 1.0  # one finite logit, the rest -inf
    x[1] = 0.0
    x[1, ::3] = -0.0  # equal zeros of both signs
    x[2, 500:] = 2.0  # equal logits across groups, none in the first ones
    x[3, 900:] = torch.arange(124.0)  # the largest in the last group
    check("specials", x, 16, 16)
    # the loss pass's case: the maxima given by the statistics, bf16 logits
    x = (3 * torch.randn(12, 64 * 16, generator=g)).to(torch.bfloat16)
    gmax = logit_statistics(True, False)(x, torch.zeros(12, dtype=torch.long), torch.float32, 16)[3]
    check("given maxima", x, 16, 16, group_max=gmax)
    # logits with a row stride past the columns, written into rows of bigger buffers (non-zero offset)
    big = torch.randint(-20, 20, (10, 64 * 16 + 24), generator=g).to(torch.bfloat16)
    x = big[:, 8:8 + 64 * 16]
    buffers = (torch.full((30, 16), 7.0, dtype=torch.bfloat16), torch.full((30, 16), -1, dtype=torch.long))
    check("strided into buffers", x, 16, 16, out=(buffers[0][10:20], buffers[1][10:20]))
    untouched = bool((buffers[0][:10] == 7).all() and (buffers[0][20:] == 7).all()
                     and (buffers[1][:10] == -1).all() and (buffers[1][20:] == -1).all())
    # the cases left to torch: no launch, torch.topk's values
    kept = {"tail": (torch.randn(4, 64 * 16 + 5), 16, 16), "fp64": (torch.randn(4, 64 * 16).double(), 16, 16),
            "short rows": (torch.randn(4, 64 * 16), 32, 16), "group 24": (torch.randn(4, 64 * 24), 16, 24)}
    for name, (x, k, group) in kept.items():
        check(name, x, k, group)
    print(json.dumps([results, untouched]))
""")


def test_triton_kernel_is_torch_topk_in_interpreter():
    """Values equal torch.topk's (bf16 and fp32, groups of 16 to 256, k 4 to 32), ids point at them, distinct, on
    ties the lowest column (-inf and signed zeros too); any row stride, written into views of bigger buffers; one
    launch where it fits, none where torch keeps the case."""
    results, untouched = run_in_interpreter(KERNEL_SCRIPT)
    assert len(results) == 16 and untouched, results
    for name, (launches, *ok) in results.items():
        kept = name in ("tail", "fp64", "short rows", "group 24")
        assert launches == (0 if kept else 1), (name, launches)
        if kept:  # the torch paths: values only (their ids follow torch.topk on ties)
            assert ok[:3] == [True, True, True] and ok[4], (name, ok)
        else:
            assert all(ok), (name, ok)


LOSS_PASS_SCRIPT = INTERPRETER_PREAMBLE + COUNT_LAUNCHES + textwrap.dedent("""
    import torch.nn.functional as F
    from dflashkit.train import grouped_topk as grouped_topk_module
    from dflashkit.train import loss
    results = {}
    g = torch.Generator().manual_seed(13)
    vocab, k, p = 64 * loss.TOPK_GROUP, 16, 3  # DFlash2's k: 64 groups pay
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight = torch.randn(6, p, 8, generator=g), torch.randn(vocab, 8, generator=g).to(dtype)
        labels, valid = torch.randint(0, vocab, (6, p), generator=g), torch.rand(6, p, generator=g) > 0.2
        before = len(launches)
        # 2 chunks of 3 blocks
        out = loss.block_loss(hidden, weight, labels, valid, loss.LossSettings(chunk_tokens=9), top_k=k)
        n = len(launches) - before
        runs = grouped_topk_module.topk_kernel_runs
        grouped_topk_module.topk_kernel_runs = lambda *args: False  # the torch path, in the same process
        ref = loss.block_loss(hidden, weight, labels, valid, loss.LossSettings(chunk_tokens=9), top_k=k)
        grouped_topk_module.topk_kernel_runs = runs
        # the logits as the engine computes them, chunk by chunk (one matmul over all rows can round otherwise)
        logits = torch.cat([F.linear(hidden[s:s + 3].reshape(-1, 8).to(dtype), weight) for s in (0, 3)]).float()
        ids = out.top_ids.view(-1, k)
        results[str(dtype)] = [n, torch.equal(out.top_logits, ref.top_logits),
                               torch.equal(logits.gather(1, ids), out.top_logits.view(-1, k)),
                               all(len(set(r)) == k for r in ids.tolist()), torch.equal(out.top_ids, ref.top_ids),
                               all(torch.equal(getattr(out, f), getattr(ref, f)) for f in ("loss_sum", "runs"))]
    print(json.dumps(results))
""")


def test_the_loss_pass_candidates_with_the_kernel_in_interpreter():
    """block_loss(top_k=16) over a vocabulary of 64 groups of TOPK_GROUP: one launch per chunk, and the same
    candidate values (float32) as the torch path, bit for bit, and the same loss; the ids point at them, distinct,
    and on the fp32 head (no ties) are the torch path's."""
    results = run_in_interpreter(LOSS_PASS_SCRIPT)
    fp32, bf16 = results["torch.float32"], results["torch.bfloat16"]
    assert fp32 == [2, True, True, True, True, True], fp32
    assert bf16[:4] == [2, True, True, True] and bf16[5], bf16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernel_is_torch_topk_on_cuda():
    """The testbed's chunk ([2048, 49152] bf16 logits, k 16, groups of TOPK_GROUP, the maxima given by the
    statistics) and fp32 and fp16 logits: the kernel runs, and its values are torch.topk's, ids on them, distinct,
    the lowest column on ties."""
    g = torch.Generator(device="cuda").manual_seed(14)
    for dtype, rows in ((torch.bfloat16, 2048), (torch.float32, 256), (torch.float16, 256)):
        x = (3 * torch.randn(rows, 49152, device="cuda", generator=g)).to(dtype)
        gmax = logit_statistics(True, False)(x, torch.zeros(rows, dtype=torch.long, device="cuda"), torch.float32,
                                             TOPK_GROUP)[3]
        assert topk_kernel_runs(x, 16)
        values, ids = grouped_topk(x, 16, group_max=gmax)
        assert torch.equal(values, torch.topk(x, 16, dim=-1).values) and torch.equal(x.gather(1, ids), values)
        lowest = torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[:, :16]
        assert torch.equal(ids, lowest)
