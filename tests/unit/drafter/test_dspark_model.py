"""DSpark drafters (drafter/modeling_dspark.py): the Markov-biased greedy draft against a hand-written loop, the
heads' maths, a fresh drafter proposing like DFlash, lossless greedy decoding with a target, and the refusals."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.drafter.kinds.dspark import markov_proposal
from dflashkit.drafter.modeling_dspark import DSparkDraftModel, MarkovHead, markov_greedy

from support.tiny_targets import VOCAB, tiny_target_config

TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=50)


def dspark(rank=4, seed=0, scale=0.0, target=TARGET, block_size=4):
    """A DSpark drafter for ``target``; ``scale`` > 0 moves its heads off their start (random, that size)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target, num_hidden_layers=2, block_size=block_size,
                                   mask_token_id=target.vocab_size - 1, architecture="dspark", markov_rank=rank)
    model = build_drafter(cfg).eval()
    if scale:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "markov_head" in name or "confidence_head" in name:
                    p.copy_(torch.randn_like(p) * scale)
    return cfg, model


def reference_greedy(base_logits, anchor_ids, w1, w2):
    """vLLM 0.26's greedy loop (dspark/speculator.py:115-148) written out row by row: prev = anchor; for each
    position, logits + W2 @ W1[prev], argmax, that token becomes prev."""
    out, w1, w2 = [], w1.detach(), w2.detach()
    for row in range(base_logits.shape[0]):
        prev, tokens = int(anchor_ids[row]), []
        for k in range(base_logits.shape[1]):
            scores = [float(base_logits[row, k, v]) + float(w1[prev] @ w2[v]) for v in range(base_logits.shape[2])]
            prev = max(range(len(scores)), key=lambda v: (scores[v], -v))  # the first maximum, as argmax
            tokens.append(prev)
        out.append(tokens)
    return torch.tensor(out)


def test_markov_greedy_matches_the_hand_written_loop_and_uses_the_bias():
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=12, rank=3)
    with torch.no_grad():
        head.markov_w2.weight.normal_(0, 2.0)
        head.markov_w1.weight.normal_(0, 2.0)
    base = torch.randn(5, 6, 12)
    anchors = torch.randint(0, 12, (5,))
    got = markov_greedy(base, anchors, head)
    want = reference_greedy(base, anchors, head.markov_w1.weight, head.markov_w2.weight)
    assert torch.equal(got, want)
    assert not torch.equal(got, base.argmax(-1))  # the bias changed the draft: the check is not vacuous


def test_fresh_dspark_drafter_proposes_like_its_dflash_backbone():
    cfg, model = dspark()
    dflash = build_drafter(dataclasses.replace(cfg, architecture="dflash")).eval()
    missing, unexpected = dflash.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(k.startswith(("markov_head.", "confidence_head.")) for k in unexpected)
    hidden = torch.randn(3, 4, TARGET.hidden_size)
    lm_head = torch.nn.Linear(TARGET.hidden_size, TARGET.vocab_size, bias=False)
    anchors = torch.tensor([1, 2, 3])
    assert torch.equal(model.propose(hidden, anchors, lm_head), dflash.compute_logits(hidden, lm_head).argmax(-1))


def test_block_logits_and_confidence_follow_the_papers_formulas():
    _, model = dspark(scale=0.5)
    hidden = torch.randn(2, 3, TARGET.hidden_size)
    prev = torch.randint(0, TARGET.vocab_size, (2, 3))
    lm_head = torch.nn.Linear(TARGET.hidden_size, TARGET.vocab_size, bias=False)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    with torch.no_grad():
        torch.testing.assert_close(model.block_logits(hidden, prev, lm_head), lm_head(hidden) + w1[prev] @ w2.T)
        proj = model.confidence_head.proj
        want = torch.cat([hidden, w1[prev]], -1) @ proj.weight[0] + proj.bias[0]  # eq. 7 before the sigmoid
        torch.testing.assert_close(model.confidence_logits(hidden, prev), want)
    hf = model.config
    hf.confidence_head_with_markov = False  # the reference's other setting: the modeling file builds it too
    assert DSparkDraftModel(hf).confidence_head.proj.in_features == TARGET.hidden_size


def target_greedy(target, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("block_size", [2, 4])
def test_greedy_spec_generate_with_markov_drafts_gives_the_targets_tokens(block_size):
    target_config = tiny_target_config()
    torch.manual_seed(1)
    target = LlamaForCausalLM(target_config).eval()
    _, model = dspark(scale=1.0, target=target_config, block_size=block_size)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model.spec_generate(target, ids, max_new_tokens=12, stop_token_ids=None)
        assert torch.equal(got, target_greedy(target, ids, 12))


def test_sampled_spec_generate_returns_the_distributions_it_drew_from():
    target_config = tiny_target_config()
    torch.manual_seed(3)
    target = LlamaForCausalLM(target_config).eval()
    _, model = dspark(scale=1.0, target=target_config)
    hidden = torch.randn(1, 3, target_config.hidden_size)
    head = target.get_output_embeddings()
    torch.manual_seed(4)
    with torch.no_grad():
        tokens, probs = model.draft_tokens(hidden, torch.tensor([2]), head, temperature=0.7, top_p=1.0, top_k=0)
        base = model.compute_logits(hidden, head)
        prev = torch.cat([torch.tensor([2]), tokens[0, :-1]])
        torch.testing.assert_close(probs[0], torch.softmax((base[0] + model.markov_head(prev)) / 0.7, -1))
    assert tokens.shape == (1, 3) and probs.shape == (1, 3, target_config.vocab_size)


@pytest.mark.parametrize("field, value, words", [
    ("markov_rank", None, "markov_rank"), ("markov_rank", 0, "markov_rank"),
    ("draft_vocab_size", 10, "draft_vocab_size"), ("markov_head_type", "rnn", "vanilla"),
    ("logit_scale", 2.0, "logit_scale"), ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(field, value, words):
    cfg, _ = dspark()
    hf = cfg.resolved().to_hf()
    hf.markov_rank = 4
    setattr(hf, field, value)
    with pytest.raises(ValueError, match=words):
        DSparkDraftModel(hf)


def test_the_kind_signature_proposal_is_the_models_greedy_draft():
    _, model = dspark(scale=1.0)
    hidden = torch.randn(2, 3, TARGET.hidden_size)
    lm_head = torch.nn.Linear(TARGET.hidden_size, TARGET.vocab_size, bias=False)
    anchors = torch.tensor([5, 6])
    with torch.no_grad():
        logits = model.compute_logits(hidden, lm_head)
        wrapped = torch.nn.Module()
        wrapped.module = model  # as DDP holds it
        assert torch.equal(markov_proposal(wrapped, hidden, logits, anchors), model.propose(hidden, anchors, lm_head))


def test_the_dspark_kind_answers_for_itself():
    """drafter/kinds/dspark.py: its field and its bound, trees allowed, its trained block, vLLM 0.26 as "dspark"
    and no SGLang, and its config.json fields at the top level where vLLM reads them."""
    from dflashkit.drafter import KINDS
    from dflashkit.errors import UserError

    kind = KINDS["dspark"]
    kind.check_decoding("tree", 4, 4)  # trees: each node's children from its own biased logits (eval/tree.py)
    assert kind.chain_only_reason is None and kind.node_bias is not None
    with pytest.raises(UserError, match="block_size 5 > the DSpark drafter's block_size 4"):
        kind.check_decoding("chain", 5, 4)
    assert kind.served_by == {"vllm": "0.26"} and kind.vllm_method == "dspark" and kind.confidence is not None
    cfg, _ = dspark(rank=7)
    written = cfg.to_json_dict()
    assert (written["markov_rank"], written["dflash_config"]["markov_rank"]) == (7, 7)
    assert written["dspark_bonus_anchor"] is True and written["dspark_block_size"] == cfg.block_size - 1
    assert "dspark_block_size" not in dataclasses.replace(cfg, causal=True).to_json_dict()
    with pytest.raises(UserError, match="markov_rank=0"):
        dataclasses.replace(cfg, markov_rank=0)
