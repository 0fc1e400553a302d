"""Speculative decoding engine on a tiny random target (CPU, fp32, greedy).

The target has a 6-token vocabulary, so a random drafter is accepted often enough that rounds of every length
from 1 to the block size occur (asserted), which makes round-by-round comparisons meaningful.
"""

import time

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.targets.loading import cache_kwargs

from support.tiny_targets import VOCAB, prompts, tiny_target_config

BLOCK, NEW = 4, 30
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    config = tiny_target_config()
    target = LlamaForCausalLM(config).eval()
    drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=BLOCK,
                                                     mask_token_id=VOCAB - 1)).eval()
    return target, drafter


def run(target, drafter, **config):
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, **config))
    try:
        return [decoder.generate(p) for p in prompts()], [decoder.generate_autoregressive(p) for p in prompts()]
    finally:
        decoder.close()


@pytest.fixture(scope="module")
def decoded(pair):
    """``run(*pair, **config)``, once per config for the module (greedy runs: several tests compare the same)."""
    done = {}

    def runs(**config):
        key = tuple(sorted(config.items()))
        if key not in done:
            done[key] = run(*pair, **config)
        return done[key]

    return runs


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculative_equals_autoregressive(decoded, mode):
    spec, ar = decoded(mode=mode, tree_budget=12, tree_top_k=3)
    for s, a in zip(spec, ar):
        assert s.tokens == a.tokens and len(s.tokens) == NEW
        assert sum(s.acceptance_lengths) == NEW - 1  # the first token comes from the prefill
    lengths = {n for s in spec for n in s.acceptance_lengths}
    assert 1 in lengths and BLOCK in lengths  # rejections and fully accepted blocks both happened


def test_chain_tau_equals_reference_round_by_round(pair, decoded, tmp_path, monkeypatch):
    import dflash.model as ref  # the reference package: a dev dependency, installed by `make test`
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # the reference times with CUDA syncs
    target, drafter = pair
    save_drafter(drafter, tmp_path / "drafter")
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "drafter"), dtype=torch.float32).eval()
    spec, _ = decoded()
    assert target.config._attn_implementation == "sdpa"  # close() gave it back
    seen = set()
    for prompt, ours in zip(prompts(), spec):
        stats = ref.dflash_generate(theirs, target, torch.tensor([prompt]), NEW, None, return_stats=True)
        assert ours.acceptance_lengths == stats.acceptance_lengths
        assert ours.tokens == stats.output_ids[0, len(prompt):].tolist()
        seen.update(ours.acceptance_lengths)
    assert seen == set(range(1, BLOCK + 1))


def test_top1_tree_gives_the_chain_rounds(decoded):
    chain, _ = decoded()
    tree, _ = decoded(mode="tree", tree_budget=BLOCK, tree_top_k=1)
    for c, t in zip(chain, tree):
        assert c.acceptance_lengths == t.acceptance_lengths and c.tokens == t.tokens
        assert t.nodes_per_round == c.nodes_per_round and max(t.nodes_per_round) == BLOCK


def test_tree_tau_at_least_chain_tau(decoded):
    chain, _ = decoded()
    tree, _ = decoded(mode="tree", tree_budget=16, tree_top_k=3)
    tau = [sum(n for r in runs for n in r.acceptance_lengths) / sum(len(r.acceptance_lengths) for r in runs)
           for runs in (chain, tree)]
    assert tau[1] >= tau[0] and tau[1] > 1.0, tau
    assert max(n for r in tree for n in r.nodes_per_round) == 16


def test_compacted_cache_equals_autoregressive_cache(pair):
    """After tree rounds (non-contiguous accepted paths), the kept K/V = a plain forward over the same tokens."""
    target, drafter = pair
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(mode="tree", max_new_tokens=NEW, tree_budget=12,
                                                               tree_top_k=3))
    prompt = prompts()[3]
    result = decoder.generate(prompt)
    cache = decoder.verifier.cache
    decoder.close()
    sequence = prompt + result.tokens[:-1]  # the last token is the next anchor, not yet in the cache
    assert cache.length == len(sequence)
    reference = DynamicCache()
    with torch.no_grad():
        target(torch.tensor([sequence]), use_cache=True, **cache_kwargs(target, reference))
    for layer in range(target.config.num_hidden_layers):
        keys = reference.layers[layer].keys
        values = reference.layers[layer].values
        assert (cache.keys[layer][:, :, :cache.length] - keys).abs().max() < 1e-5
        assert (cache.values[layer][:, :, :cache.length] - values).abs().max() < 1e-5


def test_full_attention_drafters_take_the_static_draft_path(pair):
    """The reference comparison above runs through the static drafter cache (the CUDA-graph layout)."""
    target, drafter = pair
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW))
    decoder.generate(prompts()[0])
    decoder.close()
    assert decoder.static_drafter is not None and BLOCK in decoder.static_drafter.steps
    assert decoder.static_drafter.cache.keys  # the context K/V live in the static buffers


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_prepare_builds_every_step_and_changes_no_output(pair, decoded, mode):
    """prepare() (on CUDA: the captures) runs each decode step once on dummy inputs before a run, and warm_up() a
    prompt's prefill and first round; every shape the run takes exists afterwards, and the tokens and rounds are
    those of a decoder built lazily."""
    target, drafter = pair
    config = dict(mode=mode, tree_budget=12, tree_top_k=3)
    lazy, lazy_ar = decoded(**config)
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, **config))
    decoder.prepare(max(map(len, prompts())))
    shapes, draft_sizes = set(decoder.verifier.steps), set(decoder.static_drafter.steps)
    compactions = set(decoder.verifier.compactions)
    warm = [decoder.generate(p, max_new_tokens=BLOCK + 1) for p in prompts()]  # what warm_up runs
    spec = []
    for p in prompts():
        decoder.warm_up(p)
        spec.append(decoder.generate(p))
    ar = [decoder.generate_autoregressive(p) for p in prompts()]
    decoder.close()
    assert all(w.tokens == s.tokens[:BLOCK + 1] for w, s in zip(warm, spec))
    assert [(r.tokens, r.acceptance_lengths, r.drafts) for r in spec] == \
        [(r.tokens, r.acceptance_lengths, r.drafts) for r in lazy]
    assert [r.tokens for r in ar] == [r.tokens for r in lazy_ar]
    chain_steps = {(n, True) for n in range(2, BLOCK + 1)} if mode == "chain" else {(12, False)}
    assert shapes == {(1, True)} | chain_steps and draft_sizes == set(range(2, BLOCK + 1))
    assert compactions == ({12} if mode == "tree" else set())
    assert set(decoder.verifier.steps) == shapes and set(decoder.static_drafter.steps) == draft_sizes  # no new shape
