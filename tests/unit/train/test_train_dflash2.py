"""DFlash2 drafters in the trainer (CPU): the selector term trains the selector, packing changes nothing, runs
from shards and online train, resume continues the same run, and the export loads strictly in the reference."""

import json
import shutil

import dflash.model as ref
import pytest
import torch

from dflashkit.train.data import CollateOptions, collate_blocks
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support.packed_blocks import Head, drafter_pass, make_samples, tiny_drafter
from support.training import online_overrides, tiny_overrides
from support.training import train_losses as losses

DFLASH2 = {"selector_rank": 8, "selector_top_k": 8, "conv_group_size": 8}


def tiny_dflash2(V, H, B):
    return tiny_drafter(V, H, B, architecture="dflash2", **DFLASH2)


def test_each_drafter_kind_trains_with_the_extra_term_registered_for_it(monkeypatch):
    """The trainer's pass asks EXTRA_LOSS_TERMS for the term its kind names (drafter/kinds/: loss_term), never the
    model's attributes: DFlash2 gets its selector term, DFlash none, and an entry changed is followed."""
    from dflashkit.drafter import KINDS
    from dflashkit.train import drafter_pass as pass_module

    names = {kind.loss_term for kind in KINDS.values()}
    assert names == {None, "candidate_selector", "dspark"} and set(pass_module.EXTRA_LOSS_TERMS) == names - {None}
    torch.manual_seed(0)
    V, H, B = 40, 32, 4
    head = Head(V, H, scale=1.5).double()
    packed = collate_blocks(make_samples([14, 9], V, H, seed=1),
                            CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2))
    layers = ["full_attention"] * 2
    assert drafter_pass(tiny_drafter(V, H, B), head, packed, B, layers, None, "ce")[0].selector is None
    dflash2 = tiny_dflash2(V, H, B)
    assert drafter_pass(dflash2, head, packed, B, layers, None, "ce")[0].selector is not None
    monkeypatch.setitem(pass_module.EXTRA_LOSS_TERMS, "candidate_selector", None)
    assert drafter_pass(dflash2, head, packed, B, layers, None, "ce")[0].selector is None


def test_selector_term_is_the_sum_of_per_sequence_terms_and_trains_the_selector():
    torch.manual_seed(0)
    V, H, B = 40, 32, 4
    model, head = tiny_dflash2(V, H, B), Head(V, H, scale=1.5).double()
    samples = make_samples([14, 9, 21], V, H, seed=1)
    opts = CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2)
    packed = collate_blocks(samples, opts)
    layers = ["full_attention"] * 2
    out, _ = drafter_pass(model, head, packed, B, layers, None, "ce")
    parts = [drafter_pass(model, head, collate_blocks([s], opts, pad_multiple=1), B, layers, None, "ce")[0]
             for s in samples]
    torch.testing.assert_close(out.selector.loss_sum, sum(p.selector.loss_sum for p in parts), rtol=1e-9, atol=1e-12)
    assert int(out.selector.counted) == sum(int(p.selector.counted) for p in parts) > 0
    out.selector.loss_sum.backward()  # at the start (zero successor codebook) only that codebook gets a gradient
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["candidate_selector.successor_codebook"].abs().sum() > 0
    assert grads["candidate_selector.hidden_projection.weight"].abs().sum() == 0
    selector = model.candidate_selector
    opt = torch.optim.Adam(selector.parameters(), lr=0.05)
    first = None
    for _ in range(15):
        opt.zero_grad()
        term = drafter_pass(model, head, packed, B, layers, None, "ce")[0].selector
        loss = term.loss_sum / term.weight_sum
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first
    model.zero_grad()  # once the codebook has moved, the gradient reaches the projection and the drafter's layers
    drafter_pass(model, head, packed, B, layers, None, "ce")[0].selector.loss_sum.backward()
    for name in ("candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                 "layers.1.mlp.down_proj.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


@pytest.mark.slow
@pytest.mark.parametrize("codebook_lr_scale", [1.0, 10.0])
def test_dflash2_trains_from_shards_resumes_and_exports_for_the_reference(tiny_run, tmp_path, codebook_lr_scale):
    """At 10 the codebooks' optimizer group of their own goes through the checkpoint and back too."""
    target, shards = tiny_run
    kw = dict(drafter_architecture="dflash2", drafter={"intermediate_size": 64, **DFLASH2}, keep_last=10,
              selector_codebook_lr_scale=codebook_lr_scale)
    straight = tmp_path / "straight"
    summary = train(load_config(None, [], **tiny_overrides(shards, straight, **kw)))
    assert summary["step"] == 10
    sel = losses(straight, "train/selector_loss")
    assert sorted(sel) == list(range(1, 11)) and all(v == v and v >= 0 for v in sel.values())
    # a run that resumes from the straight run's step-6 checkpoint logs the same steps 7..10
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-00000006", resumed / "checkpoints" / "step-00000006")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train(load_config(None, [], **tiny_overrides(shards, resumed, **kw)))
    for key in ("train/loss", "train/selector_loss"):
        a, b = losses(straight, key), losses(resumed, key)
        assert sorted(b) == [7, 8, 9, 10]
        for step in b:
            assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-9), (key, step)
    theirs, info = ref.DFlash2DraftModel.from_pretrained(str(straight / "export"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.slow
def test_dflash2_packed_run_equals_unpacked_run(tiny_run, tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    target, shards = tiny_run
    kw = dict(drafter_architecture="dflash2", drafter={"intermediate_size": 64, **DFLASH2}, epochs=1)
    for name, extra in (("packed", dict(micro_batch_tokens=10_000, grad_accum=1)),
                        ("unpacked", dict(micro_batch_tokens=0, grad_accum=10))):
        train(load_config(None, [], **tiny_overrides(shards, tmp_path / name, **kw, **extra)))
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    for key in ("train/loss", "train/selector_loss"):
        a, b = losses(tmp_path / "packed", key), losses(tmp_path / "unpacked", key)
        assert sorted(a) == sorted(b) == [1]
        assert a[1] == pytest.approx(b[1], rel=1e-5), key


@pytest.mark.slow
def test_dflash2_trains_online(chat_run, tmp_path):
    """Online, with the selector's unary logits coupled to the drafter (selector_unary_grad), missing labels
    injected among the candidates (selector_missing_label) and its pairwise term kept off the layers
    (selector_hidden_grad; the offline runs above keep the defaults): the trainer and its held-out passes take
    them all."""
    target, data, _ = chat_run
    out = tmp_path / "online"
    train(load_config(None, [], target=target, data=[data], **online_overrides(
        out, drafter_architecture="dflash2", selector_unary_grad=True, selector_missing_label="inject",
        selector_hidden_grad=False, drafter={"intermediate_size": 64, **DFLASH2})))
    assert json.loads((out / "summary.json").read_text())["step"] >= 1
    sel = losses(out, "train/selector_loss")
    assert sel and all(v == v and v >= 0 for v in sel.values())
    assert all(v == v for v in losses(out).values())


def test_a_kinds_own_drafter_field_needs_that_kind():
    """``drafter:`` fields that belong to one kind (drafter/kinds/: config_fields) are refused for another, naming
    the kind whose field it is and the setting that fixes it; for their own kind they pass."""
    from dflashkit.errors import UserError

    with pytest.raises(UserError, match=r"drafter.selector_rank is a DFlash2 field, unused by "
                                        r"drafter_architecture=dflash; drop it or set drafter_architecture=dflash2"):
        load_config(None, [], shards="unused", drafter={"selector_rank": 8})
    cfg = load_config(None, [], shards="unused", drafter_architecture="dflash2", drafter={"selector_rank": 8})
    assert cfg.drafter == {"selector_rank": 8}
