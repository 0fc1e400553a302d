"""train/loss.py's one engine: the objectives differ only in their per-position weights and soft share."""

import ast

import pytest
import torch

from dflashkit.train.loss import LossSettings, block_loss
from dflashkit.train.objectives import objective

from support.loss_inputs import random_loss_inputs
from support.paths import ROOT


def loss_and_grad(variant, **kw):
    hidden, weight, labels, valid, teacher = random_loss_inputs(n=5, p=4, h=12, v=30, invalid=0.3)
    h = hidden.clone().requires_grad_(True)
    out = block_loss(h, weight, labels, valid, LossSettings(variant, chunk_tokens=8, **kw), teacher_hidden=teacher)
    out.loss_sum.backward()
    return out, h.grad


def test_kl_with_no_soft_share_is_ce_exactly():
    """kl_weight=0 leaves the teacher out of the term and the gradient: the engine gives ce's numbers bit for bit."""
    ce, g_ce = loss_and_grad("ce")
    kl, g_kl = loss_and_grad("kl", kl_weight=0.0)
    for name in ("loss_sum", "ce_sum", "correct", "counted", "tau_sum", "runs", "blocks"):
        assert torch.equal(getattr(kl, name), getattr(ce, name)), name
    assert torch.equal(g_kl, g_ce)


def test_the_objectives_share_the_metrics_and_differ_in_the_loss():
    outs = {v: loss_and_grad(v)[0] for v in ("ce", "dpace", "kl")}
    for name in ("ce_sum", "correct", "counted", "tau_sum", "runs"):  # the one metrics block: same for all three
        assert torch.equal(getattr(outs["dpace"], name), getattr(outs["ce"], name)), name
        assert torch.equal(getattr(outs["kl"], name), getattr(outs["ce"], name)), name
    assert len({float(o.loss_sum.detach()) for o in outs.values()}) == 3


def test_objective_weights():
    ce = torch.tensor([[0.5, 1.0, 2.0]])
    valid = torch.tensor([[1.0, 1.0, 0.0]])
    decay = torch.tensor([1.0, 0.5, 0.25])
    assert objective("ce").soft == 0.0 and objective("kl", kl_weight=0.3).soft == pytest.approx(0.3)
    assert torch.equal(objective("ce").weights(ce, valid, decay), torch.tensor([[1.0, 0.5, 0.0]]))
    w = objective("dpace", dpace_alpha=1.0).weights(ce, valid, decay)  # alpha 1: q~ = 1, w_j = valid labels >= j
    assert torch.equal(w, torch.tensor([[2.0, 1.0, 0.0]]))


def test_split_attention_does_not_import_the_mask_rules():
    """The block-mask builders use the split form's mask object; the split form imports nothing back."""
    tree = ast.parse((ROOT / "train" / "split_attention.py").read_text())
    names = {(node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    names |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not [n for n in names if "block_mask" in n], names
