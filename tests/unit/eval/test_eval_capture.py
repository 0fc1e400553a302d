"""Eval reads the same layer features as extraction and training: the chain verifier and the hybrid verifier
capture through dflashkit.targets.capture, with layer L - 1 (the last one) among the ids, so its feature is the
final-norm output there too (not the raw layer output)."""

import pytest
import torch

from dflashkit.eval.hybrid import HybridChainVerifier
from dflashkit.eval.verifier import TargetVerifier
from dflashkit.targets.loading import load_target
from dflashkit.targets.runtime.parts import attention_only

from support.tiny_targets import capture_features, save_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


LAYER_IDS = [1, 3]  # 4 layers: 3 is L - 1 (taps in layer order, as every drafter lists them)


def _verifier(target):
    if not attention_only(target.model):
        return HybridChainVerifier(target.model, LAYER_IDS)
    verifier = TargetVerifier(target.model, LAYER_IDS, backend="torch")
    verifier.reserve(64)
    return verifier


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_verifier_features_equal_extraction_features(family, tmp_path):
    target = load_target(save_tiny_target(family, tmp_path / family))
    assert (not attention_only(target.model)) == (family == "qwen3_5_text")
    sequence = torch.randint(4, 244, (20,), generator=torch.Generator().manual_seed(0))
    extracted, _ = capture_features(target, sequence[None], None, LAYER_IDS)  # what extraction stores
    extracted = extracted[0]
    # the L - 1 part is the final-norm output, which differs from the raw output of the last layer
    seen = {}
    handle = target.layers[3].register_forward_hook(lambda m, a, o: seen.update(raw=o[0] if isinstance(o, tuple)
                                                                                   else o))
    with torch.no_grad():
        expected_logits = target.model(sequence[None, :12], use_cache=False).logits[0]
    handle.remove()
    assert not torch.allclose(seen["raw"][0], extracted[:12, 64:], atol=1e-3)

    verifier = _verifier(target)
    try:
        logits, features = verifier.forward(sequence[:12])  # prefill
        verifier.commit(list(range(12)))
        torch.testing.assert_close(features, extracted[:12], atol=2e-5, rtol=1e-4)
        _, features = verifier.forward(sequence[12:16])  # a chain block of 4
        torch.testing.assert_close(features, extracted[12:16], atol=2e-5, rtol=1e-4)
        verifier.commit([0, 1])  # a partial acceptance (the hybrid verifier rolls back and re-runs)
        _, features = verifier.forward(sequence[14:20])
        verifier.commit(list(range(6)))
        torch.testing.assert_close(features, extracted[14:20], atol=2e-5, rtol=1e-4)
        # the logits are the target's own, in fp32, from the final hidden state
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=1e-4)
    finally:
        verifier.close()
