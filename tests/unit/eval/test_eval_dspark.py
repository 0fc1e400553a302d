"""DSpark drafters in the live evaluator: the chain's drafts are chosen left to right with the Markov bias, as
vLLM 0.26 applies it (drafter/modeling_dspark.py ``markov_greedy``), a tree's nodes each get the children of their
own biased distribution, greedy decoding stays the target's own, and the confidence head's cut
(eval/confidence_cut.py) shortens what each round verifies without changing the output.

The 6-token tiny target and a DSpark drafter whose heads are moved off their start (so the bias changes drafts).
"""

from functools import partial

import pytest
import torch
from transformers import LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter, drafter_kind
from dflashkit.drafter.modeling_dspark import markov_greedy
from dflashkit.errors import UserError
from dflashkit.eval.confidence_cut import confidence_cut_report
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.eval.tree import build_tree

from support.tiny_targets import VOCAB, prompts, tiny_target_config

BLOCK, NEW = 4, 24
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_target_config()).eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    config = DrafterConfig.for_target(target.config, num_hidden_layers=2, block_size=BLOCK, target_layer_ids=[1, 2],
                                      mask_token_id=VOCAB - 1, architecture="dspark", markov_rank=3,
                                      initializer_range=0.3)
    model = build_drafter(config)
    with torch.no_grad():  # heads off their start: the bias and the confidence both vary
        for name, p in model.named_parameters():
            if "markov_head." in name or "confidence_head." in name:
                p.copy_(torch.randn_like(p) * 1.5)
    return model.eval()


def target_greedy(target, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


def decode(target, drafter, **config):
    with SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, **config)) as decoder:
        return [decoder.generate(p) for p in prompts(5)]


def test_greedy_chain_is_lossless_and_drafts_with_the_markov_bias(target, drafter, monkeypatch):
    from dflashkit.eval import draft_step

    seen = []  # every round's (backbone logits, anchor, proposal)

    def recording(model, hidden, lm_head, anchor):
        draft = draft_from_hidden(model, hidden, lm_head, anchor)
        seen.append((draft.logits.clone(), anchor.clone(), draft.tokens.clone()))
        return draft

    draft_from_hidden = draft_step.draft_from_hidden
    monkeypatch.setattr(draft_step, "draft_from_hidden", recording)
    monkeypatch.setattr("dflashkit.eval.decoder.draft_from_hidden", recording)
    results = decode(target, drafter, static_draft=False)
    for prompt, result in zip(prompts(5), results):
        assert result.tokens == target_greedy(target, prompt, NEW)
    assert seen and len({n for r in results for n in r.acceptance_lengths}) >= 2
    with torch.inference_mode():  # the recorded tensors are the decoder's (inference mode)
        for logits, anchor, tokens in seen:  # the proposal is the Markov walk of the backbone's logits
            assert torch.equal(tokens, markov_greedy(logits[None], anchor, drafter.markov_head)[0])
    assert any(not torch.equal(tokens, logits.argmax(-1)) for logits, _, tokens in seen)  # the bias mattered


def test_the_confidence_cut_verifies_fewer_tokens_and_keeps_the_output(target, drafter):
    full = decode(target, drafter)
    cut = decode(target, drafter, confidence_threshold=0.5)
    for prompt, a, b in zip(prompts(5), full, cut):
        assert b.tokens == a.tokens == target_greedy(target, prompt, NEW)
    full_nodes = [n for r in full for n in r.nodes_per_round]
    cut_nodes = [n for r in cut for n in r.nodes_per_round]
    assert set(full_nodes) <= {1 + d for d in range(1, BLOCK)} and max(full_nodes) == BLOCK
    assert min(cut_nodes) < BLOCK  # some round verified fewer drafts than the chain holds
    report = confidence_cut_report(0.5, cut, full)
    assert report["with"]["verified_per_round"] < report["without"]["verified_per_round"]
    assert report["with"]["tau"] == pytest.approx(sum(n for r in cut for n in r.acceptance_lengths) / len(cut_nodes))


def test_the_cut_at_threshold_zero_is_no_cut(target, drafter):
    assert [r.nodes_per_round for r in decode(target, drafter, confidence_threshold=0.0)] == \
        [r.nodes_per_round for r in decode(target, drafter)]


def test_sampled_chain_draws_each_position_given_the_token_drawn_before(target, drafter):
    from dflashkit.drafter.kinds import drafter_kind

    kind = drafter_kind(drafter)
    logits = torch.randn(BLOCK - 1, VOCAB)
    tokens, probs = kind.sample_path(drafter, logits, 2, lambda x: torch.softmax(x / 0.7, -1),
                                     torch.Generator().manual_seed(0))
    prev = torch.cat([torch.tensor([2]), tokens[:-1]])
    with torch.no_grad():
        torch.testing.assert_close(probs, torch.softmax((logits + drafter.markov_head(prev)) / 0.7, -1))
    results = decode(target, drafter, temperature=0.7)
    assert all(len(r.tokens) == NEW for r in results)


def test_a_top_1_tree_is_the_markov_walk_and_each_node_has_its_own_children(drafter):
    logits = torch.randn(BLOCK - 1, VOCAB, generator=torch.Generator().manual_seed(5))
    bias = partial(drafter_kind(drafter).node_bias, drafter)
    with torch.no_grad():
        chain = build_tree(2, logits, budget=BLOCK, top_k=1, node_bias=bias)
        assert chain.is_chain() and chain.tokens[1:] == markov_greedy(logits[None], torch.tensor([2]),
                                                                      drafter.markov_head)[0].tolist()
        tree = build_tree(2, logits, budget=12, top_k=3, node_bias=bias)
        for node in range(tree.num_nodes):  # each node's children: the best of its own biased distribution
            kids = [tree.tokens[c] for c in range(tree.num_nodes) if tree.parents[c] == node]
            if kids:
                row = logits[tree.depths[node]] + drafter.markov_head(torch.tensor([tree.tokens[node]]))[0]
                assert kids == row.topk(len(kids)).indices.tolist()
        plain = build_tree(2, logits, budget=12, top_k=3)
    assert [tree.tokens[c] for c in range(tree.num_nodes) if tree.depths[c] == 2] != \
        [plain.tokens[c] for c in range(plain.num_nodes) if plain.depths[c] == 2]  # the bias changed the tree


def test_greedy_tree_is_lossless(target, drafter):
    for prompt, result in zip(prompts(5), decode(target, drafter, mode="tree", tree_budget=8, tree_top_k=2)):
        assert result.tokens == target_greedy(target, prompt, NEW)


@pytest.mark.parametrize("config, words", [(dict(mode="tree", confidence_threshold=0.5), "--mode chain"),
                                           (dict(confidence_threshold=1.0), r"\[0, 1\)")])
def test_what_a_dspark_drafter_cannot_decode_is_refused(target, drafter, config, words):
    with pytest.raises(UserError, match=words):
        SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, **config))


def test_a_cut_asked_of_a_drafter_without_a_confidence_head_is_refused(target, drafter):
    import dataclasses

    dflash = build_drafter(dataclasses.replace(drafter.dflash, architecture="dflash")).eval()
    with pytest.raises(UserError, match="confidence head"):
        SpeculativeDecoder(target, dflash, DecodeConfig(max_new_tokens=NEW, confidence_threshold=0.5))
