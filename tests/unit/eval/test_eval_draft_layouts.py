"""Every drafter layout takes the static draft step (static cache, masks over cache slots, CUDA-graph captured
on a GPU) and proposes exactly what the eager DynamicCache path and the reference `dflash_generate` propose.

The 6-token tiny target of test_eval_decoder.py; blocks of 4 against a window of 3, so the window cuts both the
context and the block (causal inside it), and prompts of 8 + 30 new tokens, so the context outgrows the window.
"""

import time

import pytest
import torch
from transformers import LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder

from support.tiny_targets import VOCAB, prompts, tiny_target_config

BLOCK, NEW, WINDOW = 4, 30, 3
LAYOUTS = {
    "sliding": ["sliding_attention", "sliding_attention"],
    "mixed": ["sliding_attention", "full_attention"],
    "causal": ["full_attention", "full_attention"],  # causal inside the block, whole context (CAUSAL)
}
CAUSAL = {"causal"}  # layouts built with DrafterConfig.causal
PLAIN = {"plain": ["full_attention", "full_attention"]}  # the non-causal default, for comparisons
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_target_config()).eval()


def make_drafter(target, layout, device="cpu"):
    torch.manual_seed(1)
    layer_types = {**LAYOUTS, **PLAIN}[layout]
    window = WINDOW if "sliding_attention" in layer_types else None
    config = DrafterConfig.for_target(target.config, num_hidden_layers=len(layer_types), block_size=BLOCK,
                                      target_layer_ids=[1, 2], mask_token_id=VOCAB - 1, layer_types=layer_types,
                                      sliding_window=window, causal=layout in CAUSAL,
                                      initializer_range=0.3)  # large weights: proposals that depend on the keys
    return build_drafter(config).to(device).eval()


def decode(target, drafter, n=6, **config):
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, **config))
    try:
        return decoder, [decoder.generate(p) for p in prompts(n)]
    finally:
        decoder.close()


def rounds(results):
    return [(r.tokens, r.acceptance_lengths, r.drafts) for r in results]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sliding_layouts_take_the_static_step(target, layout):
    drafter = make_drafter(target, layout)
    decoder, _ = decode(target, drafter, n=1)
    static = decoder.static_drafter
    assert static is not None and set(static.steps) <= set(range(2, BLOCK + 1)) and BLOCK in static.steps
    assert sorted(static.rules) == sorted(set(LAYOUTS[layout]))
    if "sliding_attention" in LAYOUTS[layout]:
        assert static.rules["sliding_attention"] == (True, WINDOW)  # causal with the window, as the drafter reads it
    if layout in CAUSAL:
        assert static.rules["full_attention"] == (True, None)  # causal inside the block, no window
    assert set(static.cache.keys) == set(range(len(LAYOUTS[layout])))  # every layer's K/V in the static buffers
    eager = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, static_draft=False))
    assert eager.static_drafter is None
    eager.close()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_static_step_proposes_what_the_eager_path_does(target, layout, mode):
    drafter = make_drafter(target, layout)
    config = dict(mode=mode, tree_budget=10, tree_top_k=3)
    _, static = decode(target, drafter, **config)
    _, eager = decode(target, drafter, static_draft=False, **config)
    assert rounds(static) == rounds(eager)
    assert {n for r in static for n in r.acceptance_lengths} >= {1, 2}  # rejections and accepted drafts
    assert len({tuple(d) for r in static for d in r.drafts}) > 5  # the proposals vary from round to round


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_static_step_equals_reference_round_by_round(target, layout, tmp_path, monkeypatch):
    import dflash.model as ref

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # the reference times with CUDA syncs
    drafter = make_drafter(target, layout)
    save_drafter(drafter, tmp_path / "drafter")
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "drafter"), dtype=torch.float32).eval()
    _, ours = decode(target, drafter)
    for prompt, result in zip(prompts(6), ours):
        stats = ref.dflash_generate(theirs, target, torch.tensor([prompt]), NEW, None, return_stats=True)
        assert result.acceptance_lengths == stats.acceptance_lengths
        assert result.tokens == stats.output_ids[0, len(prompt):].tolist()


def test_the_window_changes_the_proposals(target):
    """Without its window the same weights propose differently: the comparisons above do test the masks."""
    full = make_drafter(target, "plain")
    _, b = decode(target, full)
    for other in ("sliding", "causal"):  # a window, or causality inside the block, changes the proposals
        drafter = make_drafter(target, other)
        drafter.load_state_dict(full.state_dict())
        _, a = decode(target, drafter)
        assert [r.drafts for r in a] != [r.drafts for r in b]
        assert len({tuple(d) for r in a for d in r.drafts}) > 5  # the proposals vary from round to round


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sliding_draft_step_replays_a_cuda_graph(layout):
    """On a GPU the sliding drafter's pass is captured and replayed, and proposes what the eager path does."""
    torch.manual_seed(0)
    gpu_target = LlamaForCausalLM(tiny_target_config()).cuda().eval()
    drafter = make_drafter(gpu_target, layout, device="cuda")
    decoder, graphed = decode(gpu_target, drafter)
    assert all(step.graph is not None for step in decoder.static_drafter.steps.values())
    _, eager = decode(gpu_target, drafter, static_draft=False, cuda_graphs=False)
    assert rounds(graphed) == rounds(eager)
