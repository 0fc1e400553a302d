"""The drafter kinds (drafter/kinds.py): one entry per DrafterConfig.architecture, looked up by name. DFlash and
DFlash2 are built and propose through it; an architecture without an entry, or a model without its config, is
refused."""

import pytest
import torch
from torch import nn

from dflashkit.drafter import KINDS, DFlash2DraftModel, DFlashDraftModel, DrafterConfig, build_drafter
from dflashkit.drafter.config import ARCHITECTURES
from dflashkit.drafter.kinds import argmax_proposal, drafter_kind, kind_for, selector_proposal

SIZES = dict(hidden_size=32, num_target_layers=4, vocab_size=64, num_hidden_layers=1, num_attention_heads=4,
             mask_token_id=63, block_size=4)
DFLASH2 = dict(architecture="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


class Wrapper(nn.Module):
    """What DDP and DeepSpeed hand the trainer: the drafter as ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_every_architecture_has_its_kind():
    assert set(KINDS) == set(ARCHITECTURES)
    assert all(kind.architecture == name for name, kind in KINDS.items())


def test_dflash_and_dflash2_dispatch_through_the_kinds():
    torch.manual_seed(0)
    dflash, dflash2 = build_drafter(DrafterConfig(**SIZES)), build_drafter(DrafterConfig(**SIZES, **DFLASH2))
    assert type(dflash) is DFlashDraftModel and type(dflash2) is DFlash2DraftModel
    assert drafter_kind(dflash).propose is argmax_proposal and drafter_kind(dflash).selector_of(dflash) is None
    kind = drafter_kind(Wrapper(dflash2))  # read through a wrapper too
    assert kind.propose is selector_proposal and kind.selector_of(Wrapper(dflash2)) is dflash2.candidate_selector
    hidden, anchor = torch.randn(2, 3, 32), torch.tensor([5, 9])
    logits = torch.randn(2, 3, 64)
    assert torch.equal(drafter_kind(dflash).propose(dflash, hidden, logits, anchor), logits.argmax(-1))
    path, _, _ = dflash2.candidate_selector.select(hidden, logits, anchor)
    assert torch.equal(kind.propose(dflash2, hidden, logits, anchor), path)


def test_an_architecture_without_a_kind_is_refused():
    with pytest.raises(ValueError, match=r"no drafter kind is registered for architecture='medusa'.*'dflash2'"):
        kind_for("medusa")
    model = build_drafter(DrafterConfig(**SIZES))
    model.dflash.architecture = "medusa"  # a config that bypassed its own check
    with pytest.raises(ValueError, match="medusa"):
        drafter_kind(model)
    del model.dflash
    with pytest.raises(TypeError, match="carries no DrafterConfig"):
        drafter_kind(model)
