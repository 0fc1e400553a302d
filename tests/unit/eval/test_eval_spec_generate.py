"""The two draft/verify round loops agree: eval/decoder.py's chain loop (dflashkit's evaluator) and the shipped
modeling file's own ``spec_generate`` (drafter/modeling_dflash.py, which ships inside exports and runs without
dflashkit, so it keeps its own loop). Greedy, fp32, CPU, the 6-token tiny target of test_eval_decoder.py: the same
new tokens and the same tokens produced per round (accepted drafts + the bonus, capped by the room left and cut
at a stop token), for a full-attention drafter and one with sliding-window layers, with and without a stop token.

``spec_generate`` returns only the sequence; its rounds are read off the target calls it makes (a forward
pre-hook records each call's first position: the prefill at 0, then one verification per round at the round's
anchor), so round r produced (anchor of round r + 1) - (anchor of round r) tokens, the last round up to the last
token of the output.
"""

import pytest
import torch
from transformers import LlamaForCausalLM

from dflashkit.drafter import DFlashDraftModel, DrafterConfig, build_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder

from support.tiny_targets import VOCAB, prompts, tiny_target_config

BLOCK, NEW, WINDOW = 4, 30, 3
# layout: (drafter layers, drafter seed); seeds under which large random weights (proposals that depend on the
# context) still give fully accepted blocks now and then
LAYOUTS = {"full": (["full_attention"], 3), "mixed": (["sliding_attention", "full_attention"], 0)}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_target_config()).eval()


def make_drafter(target, layer_types, seed):
    torch.manual_seed(seed)
    window = WINDOW if "sliding_attention" in layer_types else None
    config = DrafterConfig.for_target(target.config, num_hidden_layers=len(layer_types), block_size=BLOCK,
                                      target_layer_ids=[1, 2], mask_token_id=VOCAB - 1, layer_types=layer_types,
                                      sliding_window=window, initializer_range=0.3)
    return build_drafter(config).eval()


def spec_generate_rounds(drafter, target, prompt, stops):
    """(new tokens, tokens produced per round) of the shipped ``spec_generate``."""
    anchors = []

    def record(module, args, kwargs):
        anchors.append(int(kwargs["position_ids"][0, 0]))

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = drafter.spec_generate(target, torch.tensor([prompt]), max_new_tokens=NEW, stop_token_ids=stops)
    finally:
        handle.remove()
    assert anchors[:2] == [0, len(prompt)][:len(anchors)]  # the prefill, then (unless it gave a stop) round 1
    bounds = anchors[1:] + [out.shape[1] - 1]
    return out[0, len(prompt):].tolist(), [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("stop", [None, 2])
def test_engine_chain_rounds_equal_the_shipped_spec_generate(target, layout, stop):
    drafter = make_drafter(target, *LAYOUTS[layout])
    assert type(drafter) is DFlashDraftModel  # the class the export ships (drafter/modeling_dflash.py)
    stops = [] if stop is None else [stop]
    theirs = [spec_generate_rounds(drafter, target, p, stops) for p in prompts()]
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, stop_token_ids=tuple(stops)))
    try:
        ours = [decoder.generate(p) for p in prompts()]
    finally:
        decoder.close()
    for prompt, mine, (tokens, lengths) in zip(prompts(), ours, theirs):
        assert mine.tokens == tokens, prompt
        assert mine.acceptance_lengths == lengths, prompt
    if stop is None:  # rejections and fully accepted blocks both occur: every round length is compared
        assert {n for r in ours for n in r.acceptance_lengths} == set(range(1, BLOCK + 1))
        assert all(len(r.tokens) == NEW for r in ours)
    else:  # the stop token ends sequences early (and is kept)
        assert sum(len(r.tokens) < NEW for r in ours) >= 3
        assert all(r.tokens[-1] == stop for r in ours if len(r.tokens) < NEW)
        assert all(stop not in r.tokens[:-1] for r in ours)
