"""Sampling with temperature, top-p and top-k: the filtered distribution is the reference implementation's, and
speculative sampling emits tokens distributed as the target's own filtered samples."""

import pytest
import torch
from dflash.model import _sampling_probs as reference_sampling_probs
from transformers import LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.targets.runtime.sampling import sampling_probs

from support.tiny_targets import VOCAB, prompts, tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.8, 0.6, 20),
                                                       (1.0, 0.05, 0)])
def test_filtered_distribution_is_the_references(temperature, top_p, top_k):
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(3)) * 3
    ours = sampling_probs(logits, temperature, top_p, top_k)
    theirs = reference_sampling_probs(logits, temperature, top_p, top_k)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert torch.allclose(ours.sum(-1), torch.ones(7))
    if top_k:
        assert ((ours > 0).sum(-1) <= top_k).all()


def _z_scores(emitted: list[list[int]], contexts: list[list[int]], law) -> torch.Tensor:
    """|sum of (one-hot(token) - p)| / sqrt(sum p(1 - p)) per vocabulary entry; p = law(context)."""
    residual, variance = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for tokens, context in zip(emitted, contexts):
        for token, p in zip(tokens, law(context)):
            residual += torch.nn.functional.one_hot(torch.tensor(token), VOCAB) - p
            variance += p * (1 - p)
    return residual.abs() / variance.sqrt().clamp_min(1e-6)


def test_speculative_sampling_with_top_p_top_k_follows_the_target():
    """Over many seeds, the tokens of the first speculative round against the target's own filtered law."""
    torch.manual_seed(0)
    config = tiny_target_config(initializer_range=0.3)
    target = LlamaForCausalLM(config).eval()
    drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=4,
                                                     mask_token_id=VOCAB - 1)).eval()
    prompt = prompts(1)[0]
    settings = dict(temperature=1.5, top_p=0.9, top_k=3)
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=3, **settings))
    results = []
    for seed in range(300):
        decoder.config.seed = seed
        results.append(decoder.generate(prompt))
    decoder.close()
    assert sum(r.accepted_drafts[0] < 3 for r in results) > 50  # the residual law was used

    def law(filtered: bool):
        def probs(tokens):
            with torch.no_grad():
                logits = target(torch.tensor([prompt + tokens])).logits[0, -3:-1]
            if filtered:
                return sampling_probs(logits, **settings)
            return sampling_probs(logits, settings["temperature"])
        return probs

    emitted = [r.tokens[1:] for r in results]
    contexts = [r.tokens for r in results]
    filtered = law(filtered=True)
    z = _z_scores(emitted, contexts, filtered)
    assert z.max() < 4.5, z
    # the test has power: tokens drawn at the same places from the unfiltered law (top-p/top-k ignored) fail it
    g = torch.Generator().manual_seed(1)
    wrong = [torch.multinomial(law(filtered=False)(tokens), 1, generator=g)[:, 0].tolist() for tokens in contexts]
    assert _z_scores(wrong, contexts, filtered).max() > 4.5
