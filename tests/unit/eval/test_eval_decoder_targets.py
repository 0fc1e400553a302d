"""The engine on other kinds of targets (sliding windows + softcapping, hybrid linear attention) and with
speculative sampling. References: transformers' own greedy generate, and the target's exact distributions."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder

from support.tiny_targets import VOCAB, prompts, tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK, NEW = 4, 24


def _drafter(config):
    return build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=BLOCK,
                                                  mask_token_id=VOCAB - 1)).eval()


def _hf_greedy(model, prompt, new):
    """Greedy decoding by full recomputation with the model's own attention: no cache involved at all."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_sliding_window_and_softcap_target():
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5,
                          attn_logit_softcapping=1.5, final_logit_softcapping=5.0, query_pre_attn_scalar=8,
                          max_position_embeddings=128, initializer_range=0.3)
    target = Gemma2ForCausalLM(config).eval()
    assert "sliding_attention" in config.layer_types
    for mode in ("chain", "tree"):
        decoder = SpeculativeDecoder(target, _drafter(config), DecodeConfig(mode=mode, max_new_tokens=NEW,
                                                                           tree_budget=10, tree_top_k=3))
        results = [(decoder.generate(p), decoder.generate_autoregressive(p)) for p in prompts(4)]
        decoder.close()
        for prompt, (spec, ar) in zip(prompts(4), results):
            assert spec.tokens == ar.tokens == _hf_greedy(target, prompt, NEW)


def test_hybrid_target_chain_is_exact_and_tree_is_refused():
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_value_heads=2,
                               linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                               layer_types=["linear_attention", "full_attention"] * 2, initializer_range=0.3)
    target = Qwen3_5ForCausalLM(config).eval()
    drafter = _drafter(config)
    with pytest.raises(ValueError, match="not supported for hybrid targets"):
        SpeculativeDecoder(target, drafter, DecodeConfig(mode="tree"))
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW))
    rolled_back = 0
    for prompt in prompts(5):
        spec, ar = decoder.generate(prompt), decoder.generate_autoregressive(prompt)
        assert spec.tokens == ar.tokens == _hf_greedy(target, prompt, NEW)
        rolled_back += sum(n < m for n, m in zip(spec.acceptance_lengths, spec.nodes_per_round))
        assert max(spec.acceptance_lengths) > 1
    assert rolled_back > 0  # the restore-and-rerun path ran
    decoder.close()


def test_speculative_sampling_follows_the_target():
    """With temperature 1, each token the engine emits is distributed as the target's own next-token law.

    Over many seeds, the second and third tokens (the first speculative round) are compared with the target's
    exact conditional distribution given the tokens before them."""
    torch.manual_seed(0)
    config = tiny_target_config(initializer_range=0.3)
    target = LlamaForCausalLM(config).eval()
    drafter = _drafter(config)
    prompt = prompts(1)[0]
    draws = 300
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=3, temperature=1.0))
    results = []
    for seed in range(draws):
        decoder.config.seed = seed
        results.append(decoder.generate(prompt))
    decoder.close()
    assert sum(r.accepted_drafts[0] < BLOCK - 1 for r in results) > draws // 4  # the residual law was used
    residual, variance = torch.zeros(2, VOCAB), torch.zeros(2, VOCAB)
    with torch.no_grad():
        for result in results:
            probs = torch.softmax(target(torch.tensor([prompt + result.tokens])).logits[0, -3:-1], -1)
            residual += torch.nn.functional.one_hot(torch.tensor(result.tokens[1:]), VOCAB) - probs
            variance += probs * (1 - probs)
    # z-scores of the summed centred indicators (drawing the replacement from p instead of the residual
    # law gives z of about 6 here)
    z = residual.abs() / variance.sqrt().clamp_min(1e-6)
    assert z.max() < 4.5, z
