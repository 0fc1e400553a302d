"""Layer capture: for every family, hooked features equal Hugging Face's `output_hidden_states[i + 1]`,
padding (either side) changes nothing for real tokens, and the forward really stops early."""

import pytest
import torch

from dflashkit.targets.capture import LayerCapture, check_layer_ids, positions_from_mask
from dflashkit.targets.loading import load_target

from support.tiny_targets import TINY_FAMILIES, capture_features, save_tiny_target

LENGTHS = [9, 6, 3]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    return {f: load_target(save_tiny_target(f, root / f)) for f in TINY_FAMILIES}


def _padded(samples, side):
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), 1)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(samples):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[b, cols], mask[b, cols] = s, 1
    return ids, mask


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_capture_equals_output_hidden_states(family, side, targets):
    target = targets[family]
    samples = [torch.randint(4, 244, (n,)) for n in LENGTHS]
    ids, mask = _padded(samples, side)
    layer_ids = [0, 1, 2, 3]  # every layer, the last one included (taps must be in layer order)
    hidden, last_hidden = capture_features(target, ids, mask, layer_ids, store_last_hidden=True)
    assert hidden.shape == (3, ids.shape[1], 4 * 64) and last_hidden.shape == (3, ids.shape[1], 64)
    with torch.no_grad():
        out = target.model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                           output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    for got, want in zip(real_tokens(hidden, mask), real_tokens(expected, mask)):
        assert torch.equal(got, want)
    for got, want in zip(real_tokens(last_hidden, mask), real_tokens(out.hidden_states[-1], mask)):
        assert torch.equal(got, want)

    # each sample's real-token features are those of the sample run alone
    for b, sample in enumerate(samples):
        alone, _ = capture_features(target, sample[None], None, layer_ids)
        torch.testing.assert_close(real_tokens(hidden, mask)[b], alone[0], atol=2e-5, rtol=1e-4)


def _count_calls(modules):
    counts = [0] * len(modules)
    handles = []
    for k, module in enumerate(modules):
        def hook(m, a, o, k=k):
            counts[k] += 1
        handles.append(module.register_forward_hook(hook))
    return counts, handles


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3"])
def test_forward_stops_after_the_deepest_layer_needed(family, targets):
    target = targets[family]
    ids = torch.randint(4, 244, (2, 5))
    watched = [*target.layers, target.final_norm, target.lm_head]
    counts, handles = _count_calls(watched)
    try:
        capture_features(target, ids, None, [0, 1])
        assert counts == [1, 1, 0, 0, 0, 0]  # layers 0-1 run; layers 2-3, final norm and lm_head do not
        counts[:] = [0] * len(counts)
        hidden, last_hidden = capture_features(target, ids, None, [1], store_last_hidden=True)
        assert counts == [1, 1, 1, 1, 1, 0]  # final norm asked for: it runs, the lm_head still does not
        assert hidden.shape == (2, 5, 64) and last_hidden.shape == (2, 5, 64)
    finally:
        for handle in handles:
            handle.remove()


def test_layer_capture_reuses_hooks_and_removes_them(targets):
    target = targets["qwen3"]
    batches = [torch.randint(4, 244, (2, n)) for n in (4, 7)]
    before = [len(m._forward_hooks) for m in [*target.layers, target.final_norm]]
    with LayerCapture(target, [1, 2]) as capture:
        assert len(target.layers[1]._forward_hooks) == before[1] + 1
        results = [capture(ids) for ids in batches]
    assert [len(m._forward_hooks) for m in [*target.layers, target.final_norm]] == before
    for ids, (hidden, last_hidden) in zip(batches, results):
        assert last_hidden is None
        with torch.no_grad():
            hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        assert torch.equal(hidden, torch.cat([hs[2], hs[3]], dim=-1))
    with pytest.raises(RuntimeError, match="outside its `with` block"):
        capture(batches[0])


@pytest.mark.parametrize("bad, message", [([4], r"\[4\] outside 0\.\.3"), ([-1], "outside 0..3"),
                                           ([], "empty"), ([1, 1], "repeats")])
def test_layer_ids_are_validated(bad, message):
    with pytest.raises(ValueError, match=message) as error:
        check_layer_ids(bad, 4)
    assert "target_layer_ids" in str(error.value)


def real_tokens(x: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per sample, the rows of `x` [b, T, ...] at real (mask 1) positions, in order: padding on either side."""
    keep = attention_mask.bool().to(x.device)
    return [x[b][keep[b]] for b in range(x.shape[0])]


def test_real_tokens_and_positions_for_either_padding_side():
    x = torch.arange(2 * 4).reshape(2, 4, 1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    assert [t.flatten().tolist() for t in real_tokens(x, mask)] == [[0, 1, 2], [6, 7]]
    assert positions_from_mask(mask).tolist() == [[0, 1, 2, 2], [0, 0, 0, 1]]
