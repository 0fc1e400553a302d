"""DSpark in the trainer: its term (train/dspark_loss.py ``dspark_term``), computed chunk by chunk inside the
drafter's forward, against the materialised formulas (values and gradients), with the block loss's pass left
without a gradient, and a run refused before any step when its data lacks the target's last hidden states. The
whole road (init-drafter, train, export, eval) is tests/integration/test_dspark_pipeline.py."""


import pytest
import torch

from dflashkit.train.data import CollateOptions, collate_blocks
from dflashkit.train.drafter_pass import PassOptions, forward_blocks
from dflashkit.train.dspark_loss import (
    DSparkLossOptions,
    dspark_loss_sums,
    dspark_term,
    teacher_forced_predecessors,
)
from dflashkit.train.loss import LossSettings
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support.packed_blocks import Head, make_samples, tiny_drafter
from support.training import online_overrides, train_losses

V, H, B = 40, 32, 4


def tiny_dspark():
    torch.manual_seed(0)
    model = tiny_drafter(V, H, B, architecture="dspark", markov_rank=5)
    with torch.no_grad():  # heads off their start, so every term has a gradient to give
        model.markov_head.markov_w2.weight.normal_(0, 0.5)
    return model


def batch():
    return collate_blocks(make_samples([14, 9, 21], V, H, seed=1),
                          CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2,
                                         use_last_hidden=True))


def test_the_chunked_term_is_the_materialised_loss_with_its_gradients():
    model, head, packed = tiny_dspark(), Head(V, H, scale=1.5).double(), batch()
    seen = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: seen.update(h=o))
    # 7 rows: 2 blocks a chunk, so several chunks
    out = forward_blocks(model, head, packed,
                         PassOptions(block_size=B, layer_types=["full_attention"] * 2, sliding_window=None,
                                     loss=LossSettings(variant="ce", chunk_tokens=7)))
    hook.remove()
    assert out.loss_sum.grad_fn is None  # DSpark trains on its term alone: the block loss runs without a gradient
    out.extra.loss_sum.backward(retain_graph=True)  # the written-out loss below reuses the forward
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # the same, written out: all blocks' logits at once through the formulas of dspark_loss_sums
    n = packed.labels.shape[0]
    draft = seen["h"][0].view(n, B, -1)[:, 1:]
    prev = teacher_forced_predecessors(packed.block_ids.reshape(n, -1)[:, 0], packed.labels)
    logits = head.lm_head(draft) + model.markov_head(prev)
    target = head.lm_head(packed.last_hidden[packed.teacher_index]).detach()
    sums = dspark_loss_sums(logits, packed.labels, packed.valid, DSparkLossOptions(), target,
                            model.confidence_logits(draft, prev))
    want = sums.combined(DSparkLossOptions())
    torch.testing.assert_close(out.extra.loss_sum, want)
    torch.testing.assert_close(torch.stack([out.extra.ce, out.extra.l1, out.extra.confidence]),
                               torch.stack(list(sums)).detach())
    want.backward()
    assert got.keys() >= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                          "confidence_head.proj.weight", "fc.weight"}
    for name, g in got.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, msg=name)
    hit = (logits.argmax(-1) == packed.labels) & packed.valid
    assert int(out.extra.correct) == int(hit.sum()) and torch.equal(out.extra.runs, hit.double().cumprod(-1).sum(-1))


def test_training_needs_the_targets_last_hidden(tiny_run, tmp_path):
    from dflashkit.errors import UserError

    from support.shards import make_shards
    from support.training import tiny_overrides

    target, _ = tiny_run
    shards = make_shards(tmp_path / "shards", target, num_samples=4, last_hidden=False)
    with pytest.raises(UserError, match="drafter_architecture=dspark .*last_hidden"):
        train(load_config(None, [], **tiny_overrides(shards, tmp_path / "run", drafter_architecture="dspark",
                                                     drafter={"intermediate_size": 64, "markov_rank": 8})))
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


def test_the_term_takes_bf16_states_with_float32_heads():
    """As accelerate's bf16 mixed precision can hand it: the drafter's states bf16, the heads float32."""
    torch.manual_seed(0)
    model, head = tiny_drafter(V, H, B, architecture="dspark", markov_rank=5).float(), Head(V, H).float()
    n = 3
    labels, valid = torch.randint(0, V, (n, B - 1)), torch.ones(n, B - 1, dtype=torch.bool)
    hidden = torch.randn(1, n * B, H, dtype=torch.bfloat16, requires_grad=True)
    out = dspark_term(hidden, model, head=head, labels=labels, valid=valid,
                      prev=teacher_forced_predecessors(torch.tensor([1, 2, 3]), labels),
                      teacher=torch.randn(n, B - 1, H), options=DSparkLossOptions(), chunk_tokens=6)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and model.confidence_head.proj.weight.grad.abs().sum() > 0
    assert hidden.grad.dtype == torch.bfloat16 and hidden.grad.abs().sum() > 0


@pytest.mark.slow
def test_dspark_trains_online(chat_run, tmp_path):
    """Online, the target in the loop: the samples carry its last hidden states for the L1 and confidence terms,
    and the held-out passes log the term's CE part and the Markov draft's walk."""
    target, data, _ = chat_run
    out = tmp_path / "online"
    train(load_config(None, [], target=target, data=[data], **online_overrides(
        out, drafter_architecture="dspark", max_steps=2, drafter={"intermediate_size": 64, "markov_rank": 8})))
    term, l1 = train_losses(out, "train/dspark_loss"), train_losses(out, "train/dspark_l1")
    assert sorted(term) == sorted(l1) == [1, 2] and all(v == v and v > 0 for v in [*term.values(), *l1.values()])
    assert all(v == v for v in train_losses(out, "eval/tau_walk").values())
