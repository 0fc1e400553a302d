"""train/train_step.py on a tiny drafter: one step is the single-process update on the step's samples, a stop
vote takes no step, and a DFlash2 selector with weight 0 is neither computed nor trained."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.drafter.kinds.dflash2 import SelectorOptions
from dflashkit.train.data import CollateOptions, collate_blocks
from dflashkit.train.drafter_pass import PassOptions, forward_blocks
from dflashkit.train.loss import LossSettings
from dflashkit.train.metrics import MetricSums
from dflashkit.train.objectives import loss_denominator
from dflashkit.train.recipe import load_config
from dflashkit.train.tracking import read_metrics
from dflashkit.train.train_step import StepVotes, train_step
from dflashkit.train.trainer import train

from support.packed_blocks import Head
from support.training import tiny_overrides

V, H, B = 40, 32, 4


def drafter(architecture="dflash", **extra):
    cfg = DrafterConfig(hidden_size=H, num_target_layers=4, vocab_size=V, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_layer_ids=[0, 2],
                        block_size=B, mask_token_id=V - 1, architecture=architecture, **extra,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return build_drafter(cfg)


def micro_batches(lens_per_micro, seed=0):
    g = torch.Generator().manual_seed(seed)
    out, index = [], 0
    for lens in lens_per_micro:
        samples = []
        for n in lens:
            mask = torch.ones(n, dtype=torch.bool)
            mask[:2] = False
            samples.append({"input_ids": torch.randint(0, V - 1, (n,), generator=g), "loss_mask": mask,
                            "hidden": torch.randn(n, 2 * H, generator=g), "index": index})
            index += 1
        out.append(collate_blocks(samples, CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=5, seed=1),
                                  pad_multiple=1))
    return out


OPTIONS = PassOptions(block_size=B, layer_types=["full_attention"], sliding_window=None, backend="dense",
                      loss=LossSettings(chunk_tokens=64))


def one_step(model, head, micro, stop_requested, **config):
    from accelerate import Accelerator

    cfg = load_config(None, [], shards="unused", grad_accum=len(micro), lr=1e-2, max_grad_norm=0.0,
                      mixed_precision="no", **{"loss": "ce", **config})
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=cfg.grad_accum)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    sums = MetricSums(B - 1, accelerator.device)
    loss = LossSettings(cfg.loss, cfg.gamma, cfg.dpace_alpha, cfg.kl_weight, OPTIONS.loss.chunk_tokens)
    options = replace(OPTIONS, loss=loss, term_options=SelectorOptions(weights=cfg.selector_weights))
    result = train_step(prepared, optimizer, accelerator, head, micro, cfg=cfg, lr_factor=0.5, sums=sums,
                        pass_options=options, votes=StepVotes(stop_requested=stop_requested))
    return result, sums, optimizer


def test_one_step_is_the_update_on_the_steps_samples_normalised_once():
    torch.manual_seed(0)
    model, head = drafter(), Head(V, H)
    micro = micro_batches([[11, 7], [13]])
    reference = drafter()
    reference.load_state_dict(model.state_dict())
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    result, sums, optimizer = one_step(model, head, micro, stop_requested=False)
    assert not result.stopped and optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)
    # by hand: the loss sums of both micro-batches over the denominator of the whole step, one SGD step at lr/2
    denom = sum(loss_denominator(m.valid, "ce", 7.0) for m in micro)
    total = sum(forward_blocks(reference, head, m, OPTIONS).loss_sum for m in micro) / denom
    total.backward()
    for name, p in reference.named_parameters():
        expected = start[name] - 0.5e-2 * p.grad
        torch.testing.assert_close(model.get_parameter(name).detach(), expected, rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.equal(start[n], p.detach()) for n, p in model.named_parameters())
    logged = sums.reduce(None).metrics("train")
    assert logged["train/loss"] == pytest.approx(float(total.detach()), rel=1e-5)


def test_a_stop_vote_takes_no_step():
    torch.manual_seed(0)
    model, head = drafter(), Head(V, H)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    result, sums, _ = one_step(model, head, micro_batches([[9], [12]]), stop_requested=True)
    assert result.stopped and result.grad_norm is None
    assert all(torch.equal(start[n], p.detach()) for n, p in model.named_parameters())
    assert sums.t.abs().sum() == 0 and sums.host_tokens == 0  # nothing was computed


def test_the_selector_term_is_skipped_but_the_block_loss_is_the_same():
    torch.manual_seed(0)
    model, head = drafter("dflash2", selector_rank=4, selector_top_k=4, conv_group_size=8), Head(V, H)
    batch = micro_batches([[15, 9]])[0]
    with_term = forward_blocks(model, head, batch, OPTIONS)
    without = forward_blocks(model, head, batch, replace(OPTIONS, extra_term=False))
    assert with_term.selector is not None and without.selector is None
    assert torch.equal(with_term.loss_sum, without.loss_sum) and torch.equal(with_term.correct, without.correct)


def test_dflash2_with_selector_weight_zero_leaves_the_selector_untrained(tiny_run, tmp_path):
    from accelerate.utils import set_seed

    from dflashkit.extract.shards.manifest import read_manifest
    from dflashkit.targets.loading import load_target_head
    from dflashkit.train.setup_drafter import build_model

    target, shards = tiny_run
    cfg = load_config(None, [], **tiny_overrides(
        shards, tmp_path / "run", drafter_architecture="dflash2", selector_loss_weight=0.0, max_steps=2,
        drafter={"intermediate_size": 64, "selector_rank": 8, "selector_top_k": 8, "conv_group_size": 8}))
    summary = train(cfg)
    assert summary["step"] == 2
    assert not [r for r in read_metrics(tmp_path / "run") if "train/selector_loss" in r]
    exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    head = load_target_head(str(target), dtype=torch.float32, device="cpu")
    set_seed(cfg.seed)  # the drafter the run started from (train/setup.py: the seed alone decides it)
    initial, _ = build_model(cfg, read_manifest(str(shards)), head)
    selector = [n for n in exported if n.startswith("candidate_selector.")]
    assert len(selector) == 3
    for name in selector:
        assert torch.equal(exported[name], initial.get_parameter(name).detach().to(exported[name].dtype)), name
    assert not torch.equal(exported["fc.weight"], initial.fc.weight.detach().to(exported["fc.weight"].dtype))


@pytest.mark.parametrize("weights", ["decay", "loss"])
def test_a_dflash2_step_weighs_and_normalises_the_selector_term_as_configured(weights):
    """selector_weights: "decay" normalises the selector's term by the decay-weighted count of valid labels,
    "loss" by the block loss's own denominator (D-PACE here: the blocks with a valid label), its positions
    weighted as the block loss's; one step is that update, by hand."""
    torch.manual_seed(0)
    model, head = drafter("dflash2", selector_rank=4, selector_top_k=4, conv_group_size=8), Head(V, H)
    with torch.no_grad():  # the selector off its start (a zero successor codebook scores nothing)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    micro = micro_batches([[11, 7], [13]])
    reference = drafter("dflash2", selector_rank=4, selector_top_k=4, conv_group_size=8)
    reference.load_state_dict(model.state_dict())
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    one_step(model, head, micro, stop_requested=False, loss="dpace", selector_loss_weight=0.7,
             selector_weights=weights)
    dpace = replace(OPTIONS, loss=replace(OPTIONS.loss, variant="dpace"), term_options=SelectorOptions(weights=weights))
    outs = [forward_blocks(reference, head, m, dpace) for m in micro]
    denom = sum(loss_denominator(m.valid, "dpace", 7.0) for m in micro)
    sel_denom = sum(loss_denominator(m.valid, "dpace" if weights == "loss" else "ce", 7.0) for m in micro)
    assert sum(float(o.selector.in_candidates) for o in outs) > 0
    total = sum(o.loss_sum for o in outs) / denom + 0.7 * sum(o.selector.loss_sum for o in outs) / sel_denom
    total.backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).detach(), start[name] - 0.5e-2 * p.grad, rtol=1e-5,
                                   atol=1e-7, msg=name)
