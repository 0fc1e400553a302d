"""The lossless check: speculative tokens against HF generate (SDPA, its own cache), divergences classified by
the reference's top-1/top-2 margin. Mismatches must be 0 in fp32 and bf16, chain and tree; the check itself must
catch a wrong token."""

import pytest
import torch
from transformers import LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.eval.lossless import (
    TIE_TOLERANCE,
    ReferenceRun,
    classify,
    first_divergence,
    reference_greedy,
    reference_greedy_batch,
)

from support.tiny_targets import tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

VOCAB, NEW = 64, 40


def test_classify_ties_mismatches_and_lengths():
    ref = ReferenceRun(tokens=[5, 6, 7, 8], margins=[3.0, 0.01, 2.0, 1.0], top1_logits=[10.0, 10.0, 10.0, 10.0])
    out = classify(["a", "b", "c", "d"], [[5, 6, 7, 8], [5, 9, 1, 1], [5, 6, 0, 8], [5, 6]], [ref] * 4,
                   torch.bfloat16)
    assert out["prompts"] == 4 and out["exact_match_rate"] == 0.25 and (out["ties"], out["mismatches"]) == (1, 2)
    tie, wrong, short = out["divergences"]
    assert tie == {"prompt": "b", "token_index": 1, "speculative_token": 9, "reference_token": 6,
                   "reference_margin": 0.01, "tie_bound": TIE_TOLERANCE[torch.bfloat16] * 10.0, "kind": "tie"}
    assert (wrong["token_index"], wrong["kind"], wrong["reference_margin"]) == (2, "mismatch", 2.0)
    assert (short["token_index"], short["speculative_token"], short["kind"]) == (2, None, "mismatch")
    # the same margin is a mismatch in fp32, whose tolerance is far tighter
    assert classify(["b"], [[5, 9, 1, 1]], [ref], torch.float32)["mismatches"] == 1
    assert first_divergence([1, 2], [1, 2]) is None and first_divergence([1, 2], [1, 3]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_decoding_has_no_mismatch(dtype):
    torch.manual_seed(0)
    config = tiny_target_config(vocab_size=VOCAB)
    target = LlamaForCausalLM(config).to(dtype).eval()
    drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=4,
                                                     mask_token_id=VOCAB - 1)).to(dtype).eval()
    prompts = [torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    references = reference_greedy_batch(target, prompts, NEW, ())  # as run_eval calls it
    assert all(len(r.tokens) == NEW for r in references)
    for mode in ("chain", "tree"):
        decoder = SpeculativeDecoder(target, drafter, DecodeConfig(mode=mode, max_new_tokens=NEW, tree_budget=10,
                                                                   tree_top_k=3))
        spec = [decoder.generate(p) for p in prompts]
        decoder.close()
        assert max(n for r in spec for n in r.acceptance_lengths) > 1  # drafts were accepted
        out = classify([str(i) for i in range(4)], [r.tokens for r in spec], references, dtype)
        assert out["mismatches"] == 0, out["divergences"]
        if dtype == torch.float32:
            assert out["exact_match_rate"] == 1.0
        # the check catches a wrong token: change one where the reference was sure (in the reference's own
        # tokens: in bf16 a speculative output may already have parted from it at an earlier tie, and a run is
        # compared only up to its first divergence)
        sure = max(range(NEW), key=lambda i: references[0].margins[i])
        wrong = list(references[0].tokens)
        wrong[sure] = (wrong[sure] + 1) % VOCAB
        bad = classify(["0"], [wrong], references[:1], dtype)
        assert bad["mismatches"] == 1 and bad["divergences"][0]["token_index"] == sure
    assert target.config._attn_implementation == "sdpa"


def test_batched_reference_equals_one_prompt_calls():
    """Prompts of different lengths in one left-padded generate call give each prompt's own greedy tokens and
    margins; a prompt that reaches a stop token ends there while the others go on."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_target_config(vocab_size=VOCAB)).eval()
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14)]
    free = [reference_greedy(target, p, NEW, ()) for p in prompts]
    stop = free[1].tokens[NEW // 2]  # prompt 1 stops at (or before) its middle token
    singles = [reference_greedy(target, p, NEW, (stop,)) for p in prompts]
    assert len(singles[1].tokens) <= NEW // 2 + 1 and singles[1].tokens[-1] == stop
    batched = reference_greedy_batch(target, prompts, NEW, (stop,), batch_size=2)
    assert {len(r.tokens) for r in batched} != {NEW}  # the stop token ended at least one of them
    for one, many in zip(singles, batched):
        assert many.tokens == one.tokens
        assert torch.allclose(torch.tensor(many.margins), torch.tensor(one.margins), atol=1e-4)
        assert torch.allclose(torch.tensor(many.top1_logits), torch.tensor(one.top1_logits), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_testbed_has_no_mismatch(dtype):
    """SmolLM2-135M (the testbed), two MT-bench prompts, chain and tree: no mismatch against HF generate."""
    from dflashkit.eval.prompts import load_prompts
    from dflashkit.targets.loading import load_target

    target = load_target("testbed:smollm2", dtype=dtype)
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig.for_target(target.config, num_hidden_layers=1, block_size=8,
                                                     mask_token_id=0)).to(dtype).eval()
    prompts = [p.input_ids for p in load_prompts("builtin:mtbench", target.tokenizer, num_prompts=2)]
    references = [reference_greedy(target.model, p, 32, ()) for p in prompts]
    for mode in ("chain", "tree"):
        decoder = SpeculativeDecoder(target.model, drafter, DecodeConfig(mode=mode, max_new_tokens=32,
                                                                         tree_budget=16, tree_top_k=4))
        spec = [decoder.generate(p) for p in prompts]
        decoder.close()
        out = classify(["0", "1"], [r.tokens for r in spec], references, dtype)
        assert out["mismatches"] == 0, out["divergences"]
