"""Chunked block losses: the same value and gradients as full-logit autograd, metrics as counted by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflashkit.train.loss import LossSettings, block_loss
from dflashkit.train.objectives import loss_denominator

from support.loss_inputs import random_loss_inputs


def dpace_weights_loop(ce, valid, alpha):
    """D-PACE Eq. 7-8 written as loops: w_j = sum_{m>=j, valid} prod_{i<=m} q~_i, q~ = (1-a) exp(-ce) + a."""
    n, p = ce.shape
    w = torch.zeros(n, p)
    for b in range(n):
        qs = [((1 - alpha) * math.exp(-ce[b, i].item()) + alpha) if valid[b, i] else 1.0 for i in range(p)]
        for j in range(p):
            if not valid[b, j]:
                continue
            total = 0.0
            for m in range(j, p):
                if valid[b, m]:
                    total += math.prod(qs[: m + 1])
            w[b, j] = total
    return w


def reference(hidden, weight, labels, valid, variant, gamma=7.0, alpha=0.5, beta=0.5, teacher=None):
    logits = (hidden.double() @ weight.double().T)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape) * valid
    if variant == "dpace":
        w = dpace_weights_loop(ce.detach(), valid, alpha).double()
    else:
        w = torch.tensor([math.exp(-(k - 1) / gamma) for k in range(1, labels.shape[1] + 1)]).double() * valid
    per = ce
    if variant == "kl":
        t = torch.log_softmax(teacher.double() @ weight.double().T, -1)
        kl = (t.exp() * (t - torch.log_softmax(logits, -1))).sum(-1) * valid
        per = (1 - beta) * ce + beta * kl
    return (w * per).sum()


def make(n=6, p=7, h=16, v=50, seed=0):
    hidden, weight, labels, valid, teacher = random_loss_inputs(n, p, h, v, seed)
    valid[-1, 4:] = False  # a partial tail
    return hidden, weight, labels, valid, teacher


@pytest.mark.parametrize("variant", ["ce", "dpace", "kl"])
@pytest.mark.parametrize("chunk_tokens", [1, 14, 10_000])
def test_chunked_equals_unchunked(variant, chunk_tokens):
    hidden, weight, labels, valid, teacher = make()
    h1 = hidden.clone().requires_grad_(True)
    out = block_loss(h1, weight, labels, valid, LossSettings(variant=variant, chunk_tokens=chunk_tokens),
                     teacher_hidden=teacher)
    (out.loss_sum * 0.7).backward()
    h2 = hidden.clone().double().requires_grad_(True)
    ref = reference(h2, weight, labels, valid, variant, teacher=teacher)
    (ref * 0.7).backward()
    torch.testing.assert_close(out.loss_sum.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1.grad.double(), h2.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # compiling for the CPU takes most of a minute
@pytest.mark.parametrize("variant", ["ce", "dpace"])
def test_fused_equals_eager(variant):
    """The compiled logit kernels (fused=True; compiled for the CPU here) give the eager path's loss, metrics and
    gradients, chunks of unequal size included (10 blocks in chunks of 4)."""
    hidden, weight, labels, valid, _ = make(n=10, p=5, h=16, v=300, seed=4)
    labels[0] = (hidden[0] @ weight.T).argmax(-1)  # one block right from the start: tau and argmax count
    valid[0] = True
    outs = {}
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, weight, labels, valid, LossSettings(variant=variant, chunk_tokens=20, fused=fused))
        (out.loss_sum * 0.3).backward()
        outs[fused] = (out, h.grad)
    (a, ga), (b, gb) = outs[False], outs[True]
    for name in ("loss_sum", "ce_sum", "correct", "counted", "tau_sum", "blocks"):
        torch.testing.assert_close(getattr(b, name).float(), getattr(a, name).float(), rtol=1e-5, atol=1e-5,
                                   msg=name)
    assert a.tau_sum > a.blocks  # block 0 is right at its first position at least
    torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-6)


def test_metrics_counted_by_hand():
    hidden, weight, labels, valid, _ = make(n=5, p=4, v=20, seed=3)
    logits = hidden @ weight.T
    pred = logits.argmax(-1)
    labels[0] = pred[0]                 # block 0: all right -> tau 1 + (valid prefix run)
    labels[1, 0] = (pred[1, 0] + 1) % 20  # block 1: first position wrong -> tau 1
    valid[0] = True
    valid[1] = True
    valid[4] = False                    # block 4: no valid label (a padding block) -> counts nowhere
    out = block_loss(hidden, weight, labels, valid)
    hit = (pred == labels) & valid
    for k in range(4):
        assert out.correct[k].item() == hit[:, k].sum().item()
        assert out.counted[k].item() == valid[:, k].sum().item()
    taus = []
    for b in range(5):
        run = 0
        while run < 4 and hit[b, run]:
            run += 1
        if valid[b].any():
            taus.append(1 + run)
    assert taus[0] == 5 and taus[1] == 1 and len(taus) <= 4
    assert out.tau_sum.item() == sum(taus)
    assert out.blocks.item() == len(taus)


def test_denominators():
    valid = torch.tensor([[True, True, False], [False, False, False], [False, True, True]])
    d = [math.exp(-k / 7.0) for k in range(3)]
    assert loss_denominator(valid, "ce", 7.0).item() == pytest.approx(d[0] + d[1] + d[1] + d[2])
    assert loss_denominator(valid, "kl", 7.0).item() == pytest.approx(d[0] + d[1] + d[1] + d[2])
    assert loss_denominator(valid, "dpace", 7.0).item() == 2  # blocks with at least one label


def test_bf16_hidden_keeps_dtype_and_is_close():
    hidden, weight, labels, valid, _ = make()
    hb = hidden.bfloat16().requires_grad_(True)
    out = block_loss(hb, weight.bfloat16(), labels, valid, LossSettings(chunk_tokens=7))
    out.loss_sum.backward()
    assert hb.grad.dtype == torch.bfloat16
    ref = reference(hidden.double(), weight, labels, valid, "ce")
    assert abs(out.loss_sum.item() - ref.item()) / ref.item() < 2e-2


def test_bad_arguments():
    hidden, weight, labels, valid, _ = make()
    with pytest.raises(ValueError, match="variant"):
        block_loss(hidden, weight, labels, valid, LossSettings(variant="mse"))
    with pytest.raises(ValueError, match="last_hidden"):
        block_loss(hidden, weight, labels, valid, LossSettings(variant="kl"))
    with pytest.raises(ValueError, match="dpace_alpha"):
        block_loss(hidden, weight, labels, valid, LossSettings(variant="dpace", dpace_alpha=0.0))


@pytest.mark.slow  # compiling for the CPU
def test_fused_kernels_compile_once_per_shape_kind_whatever_the_chunk_offset():
    """A chunk's labels reach the compiled kernels at offset 0. As a slice (offset 0 for the first chunk, s*p
    after) they fell on both sides of the compiler's 0/1 specialisation: a first chunk of a new size then
    compiled each kernel once more. Here: 10 blocks in chunks of 4 (4, 4, 2), then 3 blocks (one chunk of a
    new size at offset 0). Each kernel compiles its static graph and one dynamic graph, no third."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from dflashkit.train.loss import _logit_grad, _logit_stats

    torch._dynamo.reset()
    for n in (10, 3):
        hidden, weight, labels, valid, _ = make(n=n, p=5, h=16, v=300, seed=n)
        out = block_loss(hidden.clone().requires_grad_(True), weight, labels, valid,
                         LossSettings(variant="dpace", chunk_tokens=20, fused=True))
        out.loss_sum.backward()
    for fn in (_logit_stats, _logit_grad):
        entries = len(_debug_get_cache_entry_list(fn.__code__))
        assert 1 <= entries <= 2, (fn.__name__, entries)
