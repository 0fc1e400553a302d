"""DFlash2's selector candidates come from the block loss's own lm_head pass (train/loss.py ``top_k``,
train/drafter_pass.py ``BlockLossPass``; issue 36): one step's total loss and every parameter's gradient equal
those of the earlier two-pass form, in which the drafter's forward took the top_k in an lm_head pass of its own.
The reference below is that form, written out here: the drafter's hidden states, the block loss, then the
selector's lm_head pass in chunks (``topk(logits.float())``), its pairwise scores and its term."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dflashkit.drafter.kinds.dflash2 import SelectorOptions
from dflashkit.train.data import CollateOptions, collate_blocks
from dflashkit.train.drafter_pass import PassOptions, draft_hidden, forward_blocks
from dflashkit.train.loss import LossSettings, block_loss
from dflashkit.train.objectives import loss_denominator
from dflashkit.train.selector_loss import predecessor_ids, selector_loss

from support.packed_blocks import Head, make_samples, tiny_drafter

V, H, B, CHUNK, GAMMA = 40, 32, 4, 7, 7.0  # 7 tokens: chunks of 2 blocks, the last one shorter
LAYERS = ["full_attention"] * 2
DFLASH2 = {"selector_rank": 8, "selector_top_k": 8, "conv_group_size": 8}


def setup(dtype):
    """A tiny DFlash2 drafter whose selector has moved off its start (so every parameter gets a gradient), a
    stand-in target head and one packed micro-batch, all in ``dtype``."""
    torch.manual_seed(0)
    model = tiny_drafter(V, H, B, architecture="dflash2", **DFLASH2).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off the identity convolutions and the zero successor codebook
    head = Head(V, H, scale=1.5).to(dtype)
    batch = collate_blocks(make_samples([14, 9, 21], V, H, seed=1),
                           CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2,
                                          use_last_hidden=True))
    batch = dataclasses.replace(batch, target_hidden=batch.target_hidden.to(dtype),
                                last_hidden=batch.last_hidden.to(dtype))
    return model, head, batch


def step_loss(out, valid, variant):
    """One micro-batch's total loss as train_step forms it (both terms over their own normaliser)."""
    sel = out.selector
    return out.loss_sum / loss_denominator(valid, variant, GAMMA) + 0.7 * sel.loss_sum / sel.weight_sum


def two_pass_reference(model, head, batch, variant, fused, coupled=False):
    """The block loss and, beside it, the selector's own top_k pass through the lm_head (the form before issue 36);
    ``coupled``: that pass's logits keep their autograd graph (the unary term's gradient, written the plain way)."""
    hidden = draft_hidden(model, head, batch, block_size=B, layer_types=LAYERS, sliding_window=None)
    teacher = batch.last_hidden[batch.teacher_index] if variant == "kl" else None
    out = block_loss(hidden, head.lm_head.weight, batch.labels, batch.valid,
                     LossSettings(variant=variant, gamma=GAMMA, chunk_tokens=CHUNK, fused=fused),
                     teacher_hidden=teacher)
    n, p = batch.labels.shape
    k, rows = model.candidate_selector.top_k, max(1, CHUNK // p)
    candidates = torch.empty(n, p, k, dtype=torch.long)
    pieces = []
    with torch.set_grad_enabled(coupled):
        for s in range(0, n, rows):
            top = torch.topk(F.linear(hidden[s:s + rows].to(head.lm_head.weight.dtype), head.lm_head.weight).float(),
                             k, dim=-1)
            pieces.append(top.values)
            candidates[s:s + rows] = top.indices
    unary = torch.cat(pieces) if coupled else torch.cat(pieces).detach()
    scores = model.candidate_selector.pair_scores(hidden, unary.to(hidden.dtype), candidates,
                                                  predecessor_ids(batch.block_ids, batch.labels)).float()
    out.selector = selector_loss(scores, candidates, batch.labels, batch.valid, GAMMA)
    return out, candidates


def one_step(model, head, batch, variant, fused, reference: bool, coupled: bool = False):
    model.zero_grad(set_to_none=True)
    if reference:
        out, candidates = two_pass_reference(model, head, batch, variant, fused, coupled)
    else:
        out = forward_blocks(model, head, batch,
                             PassOptions(block_size=B, layer_types=LAYERS, sliding_window=None,
                                         term_options=SelectorOptions(unary_grad=coupled),
                                         loss=LossSettings(variant=variant, gamma=GAMMA, chunk_tokens=CHUNK,
                                                           fused=fused)))
        candidates = out.top_ids  # the loss pass's top_k, handed to the selector
    loss = step_loss(out, batch.valid, variant)
    loss.backward()
    return out, candidates, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def max_abs_diffs(model, head, batch, variant, fused):
    """(new, reference) outputs and the max abs difference of the loss and over every parameter's gradient."""
    new, new_candidates, loss_new, grads_new = one_step(model, head, batch, variant, fused, reference=False)
    ref, ref_candidates, loss_ref, grads_ref = one_step(model, head, batch, variant, fused, reference=True)
    assert torch.equal(new_candidates, ref_candidates)
    assert set(grads_new) == set(grads_ref)
    for name, g in grads_ref.items():
        assert g.abs().sum() > 0, f"{name} got no gradient: the comparison would prove nothing for it"
    grad_diff = max(float((grads_new[n] - grads_ref[n]).abs().max()) for n in grads_ref)
    return new, ref, float((loss_new - loss_ref).abs()), grad_diff


def assert_same_step(new, ref, loss_diff, grad_diff):
    assert loss_diff == 0.0 and grad_diff == 0.0, (loss_diff, grad_diff)
    for name in ("loss_sum", "in_candidates", "correct", "counted", "weight_sum"):
        assert torch.equal(getattr(new.selector, name), getattr(ref.selector, name)), name
    for name in ("loss_sum", "ce_sum", "correct", "counted", "tau_sum", "runs"):
        assert torch.equal(getattr(new, name), getattr(ref, name)), name
    assert int(new.selector.in_candidates) > 0 and ref.top_ids is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", ["ce", "dpace", "kl"])
def test_candidates_from_the_loss_pass_give_the_two_pass_loss_and_gradients(variant, dtype):
    model, head, batch = setup(dtype)
    assert_same_step(*max_abs_diffs(model, head, batch, variant, fused=False))


@pytest.mark.slow  # compiling the logit kernels for the CPU takes most of a minute
def test_candidates_from_the_fused_loss_pass_give_the_two_pass_loss_and_gradients():
    """The compiled backend (fused=True; compiled for the CPU here): the top_k is the same eager op on its logits."""
    model, head, batch = setup(torch.float32)
    assert_same_step(*max_abs_diffs(model, head, batch, "dpace", fused=True))


def test_the_loss_pass_top_k_are_the_logits_top_k():
    """block_loss(top_k=k): each position's k largest logits (float32) and their ids, from every chunk; no
    candidates without top_k."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(7, 3, 16, generator=g), torch.randn(50, 16, generator=g)
    labels, valid = torch.randint(0, 50, (7, 3), generator=g), torch.ones(7, 3, dtype=torch.bool)
    out = block_loss(hidden, weight, labels, valid, LossSettings(chunk_tokens=6), top_k=5)
    top = torch.topk(hidden @ weight.T, 5, dim=-1)
    torch.testing.assert_close(out.top_logits, top.values)
    assert torch.equal(out.top_ids, top.indices) and out.top_logits.dtype == torch.float32
    plain = block_loss(hidden, weight, labels, valid, LossSettings(chunk_tokens=6))
    assert plain.top_logits is None and plain.top_ids is None and torch.equal(plain.loss_sum, out.loss_sum)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_coupled_unary_term_gives_the_gradient_of_differentiable_candidate_logits(dtype):
    """selector_unary_grad: the selector's unary logits carry their gradient to the drafter (as in the public
    DFlash2 trainers): every parameter's gradient is that of the reference whose top_k logits keep their autograd
    graph (summed in another order: equal to rounding), the loss unchanged, and the gradients differ from the
    detached form's (the option acts)."""
    model, head, batch = setup(dtype)
    new, _, loss_new, coupled = one_step(model, head, batch, "dpace", False, reference=False, coupled=True)
    _, _, loss_ref, reference = one_step(model, head, batch, "dpace", False, reference=True, coupled=True)
    _, _, loss_plain, detached = one_step(model, head, batch, "dpace", False, reference=False)
    assert int(new.selector.in_candidates) > 0 and loss_new == loss_plain
    torch.testing.assert_close(loss_new, loss_ref, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for name, g in reference.items():
        torch.testing.assert_close(coupled[name], g, **tol, msg=name)
    moved = [n for n in reference if not torch.allclose(coupled[n], detached[n], **tol)]
    assert "layers.0.mlp.down_proj.weight" in moved and not any("codebook" in n for n in moved)


def test_the_held_out_pass_is_the_same_under_every_selector_option():
    """The held-out evaluation (no_grad, the ce objective) takes the run's selector options and gives the same
    numbers: the candidates' logits are the loss pass's without a gradient, and ce's position weights and
    normaliser are the decay's."""
    model, head, batch = setup(torch.float32)
    run = PassOptions(B, LAYERS, None, loss=LossSettings("ce", GAMMA, chunk_tokens=CHUNK))
    with torch.no_grad():
        on = forward_blocks(model, head, batch,
                            dataclasses.replace(run, term_options=SelectorOptions(unary_grad=True, weights="loss")))
        off = forward_blocks(model, head, batch, run)
    assert int(off.selector.in_candidates) > 0 and torch.equal(on.top_ids, off.top_ids)
    for name in ("loss_sum", "weight_sum", "correct", "in_candidates"):
        assert torch.equal(getattr(on.selector, name), getattr(off.selector, name)), name


def test_the_loss_weighted_selector_term_takes_the_block_losss_own_position_weights():
    """selector_weights="loss": the selector's positions weighted as the block loss weighs them (D-PACE's weights
    from the block CE, the loss pass's ``position_weights``) and normalised by the block loss's denominator, where
    "decay" uses the ce decay and the decay-weighted count of valid labels."""
    from dflashkit.train.objectives import dpace_weights

    model, head, batch = setup(torch.float64)
    run = PassOptions(B, LAYERS, None, loss=LossSettings("dpace", GAMMA, chunk_tokens=CHUNK))
    with torch.no_grad():
        by_loss = forward_blocks(model, head, batch,
                                 dataclasses.replace(run, term_options=SelectorOptions(weights="loss")))
        by_decay = forward_blocks(model, head, batch, run)
        hidden = draft_hidden(model, head, batch, block_size=B, layer_types=LAYERS, sliding_window=None)
    logits = hidden @ head.lm_head.weight.T
    ce = (torch.logsumexp(logits, -1) - logits.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)) * batch.valid
    weights = dpace_weights(ce, batch.valid, 0.5)
    torch.testing.assert_close(by_loss.position_weights, weights, rtol=1e-12, atol=1e-12)
    assert torch.equal(by_loss.position_weights, by_decay.position_weights)  # the pass computes them either way
    # the selector's scores of the same candidates, by hand, then its term weighted and normalised both ways
    n = hidden.shape[0]
    full = torch.cat([torch.zeros(n, 1, H, dtype=hidden.dtype), hidden], 1).reshape(1, -1, H)  # slot 0 unused
    with torch.no_grad():
        scores, ids = model.selector_scores(full, predecessor_ids(batch.block_ids, batch.labels),
                                            lambda draft, k: (by_loss.top_logits, by_loss.top_ids))
    expected = selector_loss(scores, ids, batch.labels, batch.valid, GAMMA, weights=weights,
                             weight_sum=loss_denominator(batch.valid, "dpace", GAMMA))
    plain = selector_loss(scores, ids, batch.labels, batch.valid, GAMMA)
    for got, want in ((by_loss.selector, expected), (by_decay.selector, plain)):
        torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-6, atol=0)
        assert torch.equal(got.weight_sum, want.weight_sum) and torch.equal(got.in_candidates, want.in_candidates)
    assert int(expected.in_candidates) > 0 and not torch.allclose(expected.loss_sum, plain.loss_sum)
    assert torch.equal(expected.weight_sum, batch.valid.any(-1).sum().to(expected.weight_sum.dtype))


def test_a_missing_label_takes_the_lowest_candidates_slot_with_its_own_logit():
    """inject_missing_labels: a valid label outside the candidates replaces the lowest one, with the logit the
    loss pass would give it (states and row in the lm_head's dtype, bias added; to the dtype's rounding); a label
    found, or
    an invalid position, leaves the candidates as they are."""
    from dflashkit.train.selector_loss import inject_missing_labels

    g = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight = torch.randn(5, 3, 16, generator=g), torch.randn(50, 16, generator=g).to(dtype)
        bias = torch.randn(50, generator=g).to(dtype)
        logits = (F.linear(hidden.to(dtype), weight, bias)).float()
        top = torch.topk(logits, 4, dim=-1)
        labels = torch.randint(0, 50, (5, 3), generator=g)
        labels[0, 0] = top.indices[0, 0, 2]  # one label found among the candidates
        valid = torch.ones(5, 3, dtype=torch.bool)
        valid[4, 2] = False
        new_logits, new_ids, injected = inject_missing_labels(hidden, top.values, top.indices, labels, valid,
                                                              weight, bias)
        found = (top.indices == labels.unsqueeze(-1)).any(-1)
        assert torch.equal(injected, valid & ~found) and int(injected.sum()) >= 10 and not injected[0, 0]
        for n, p in torch.nonzero(injected).tolist():
            slot = int(top.values[n, p].argmin())
            assert int(new_ids[n, p, slot]) == int(labels[n, p])
            torch.testing.assert_close(new_logits[n, p, slot], logits[n, p, labels[n, p]],  # the pass's logit
                                       rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
            keep = [s for s in range(4) if s != slot]
            assert torch.equal(new_ids[n, p, keep], top.indices[n, p, keep])
        assert torch.equal(new_ids[~injected], top.indices[~injected])
        assert torch.equal(new_logits[~injected], top.values[~injected])


def test_injected_labels_add_terms_but_are_not_counted_as_found():
    """selector_missing_label="inject" (training): every valid position gets a selector term (a larger sum),
    recall and accuracy count what "skip" counts (as decoding would), the drafter's gradient moves with the
    unary coupling; without a gradient (the held-out pass) nothing is injected."""
    model, head, batch = setup(torch.float64)
    run = PassOptions(B, LAYERS, None, loss=LossSettings("dpace", GAMMA, chunk_tokens=CHUNK))

    def options(missing):
        return SelectorOptions(unary_grad=True, missing_label=missing)

    def step(missing):
        model.zero_grad(set_to_none=True)
        out = forward_blocks(model, head, batch, dataclasses.replace(run, term_options=options(missing)))
        step_loss(out, batch.valid, "dpace").backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (skip, g_skip), (inject, g_inject) = step("skip"), step("inject")
    assert int(skip.selector.counted) > int(skip.selector.in_candidates) > 0  # some labels are missing
    for name in ("in_candidates", "correct", "counted", "weight_sum"):
        assert torch.equal(getattr(inject.selector, name), getattr(skip.selector, name)), name
    assert float(inject.selector.loss_sum.detach()) > float(skip.selector.loss_sum.detach())
    assert torch.equal(inject.loss_sum, skip.loss_sum)  # the block loss is not touched
    name = "layers.0.mlp.down_proj.weight"
    assert not torch.allclose(g_inject[name], g_skip[name])
    with torch.no_grad():
        held = forward_blocks(model, head, batch, dataclasses.replace(run, term_options=options("inject")))
        plain = forward_blocks(model, head, batch, dataclasses.replace(run, term_options=options("skip")))
    assert torch.equal(held.selector.loss_sum, plain.selector.loss_sum)


def test_the_selectors_run_is_the_leading_run_of_its_chosen_labels():
    """runs: per block, how many positions from the first the selector chose the label at, stopping at the first
    wrong choice, invalid position or label left out of the candidates (its greedy path's accepted run)."""
    candidates = torch.tensor([[[5, 6], [7, 8], [9, 1], [2, 3]],
                               [[5, 6], [7, 8], [9, 1], [2, 3]],
                               [[5, 6], [7, 8], [9, 1], [2, 3]]])
    scores = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]] * 3)  # chooses 5, 8, 9, 3
    labels = torch.tensor([[5, 8, 1, 3],    # third choice wrong: run 2
                           [5, 8, 9, 3],    # all four right
                           [5, 4, 9, 3]])   # label 4 not among the candidates: run 1
    valid = torch.ones(3, 4, dtype=torch.bool)
    out = selector_loss(scores, candidates, labels, valid, GAMMA)
    assert out.runs.tolist() == [2, 4, 1] and int(out.correct) == 3 + 4 + 3
    valid[1, 2] = False  # an invalid position ends the run, as the block loss's runs
    assert selector_loss(scores, candidates, labels, valid, GAMMA).runs.tolist() == [2, 2, 1]


def test_the_detached_selector_term_leaves_the_drafters_layers_to_the_block_loss():
    """selector_hidden_grad=False: the selector's pairwise term reads the hidden states detached, so every
    parameter outside the selector gets the block loss's gradient alone (as with no selector term at all), the
    codebooks and the hidden projection still learn, and the loss is the same; by default the term moves the
    layers too (the option acts)."""
    model, head, batch = setup(torch.float64)
    run = PassOptions(B, LAYERS, None, loss=LossSettings("dpace", GAMMA, chunk_tokens=CHUNK))

    def grads(**options):
        model.zero_grad(set_to_none=True)
        out = forward_blocks(model, head, batch, dataclasses.replace(run, **options))
        loss = step_loss(out, batch.valid, "dpace") if out.selector is not None else (
            out.loss_sum / loss_denominator(batch.valid, "dpace", GAMMA))
        loss.backward()
        return loss.detach(), {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}

    loss_detached, detached = grads(term_options=SelectorOptions(hidden_grad=False))
    loss_coupled, coupled = grads()
    _, block_only = grads(extra_term=False)
    assert loss_detached == loss_coupled
    selector_params = [n for n in detached if n.startswith("candidate_selector.")]
    assert sorted(selector_params) == ["candidate_selector.hidden_projection.weight",
                                       "candidate_selector.predecessor_codebook",
                                       "candidate_selector.successor_codebook"]
    for name in selector_params:
        assert detached[name].abs().sum() > 0 and block_only[name] is None, name
        torch.testing.assert_close(detached[name], coupled[name], rtol=1e-12, atol=1e-14, msg=name)
    layers = [n for n in detached if n not in selector_params]
    for name in layers:
        torch.testing.assert_close(detached[name], block_only[name], rtol=1e-12, atol=1e-14, msg=name)
    assert any(not torch.allclose(coupled[n], block_only[n], rtol=1e-9, atol=1e-12) for n in layers)
