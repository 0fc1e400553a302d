"""Training and live decoding compute the same draft for the same context (fp32, CPU, greedy).

S = prompt + the target's own greedy continuation (HF generate). Training path: features of S by the one
capture (targets/capture.py LayerCapture, as extraction and online training compute them), blocks at chosen
anchors packed by train/data.py (with training's padding), the drafter pass of train/drafter_pass.py and the argmax of
the lm_head logits at draft positions 1..B-1, as train/loss.py takes it. Eval path: the live chain decoder
(eval/decoder.py) on a prefix of S. Its prefill produces the token after the prompt, which is the first round's
anchor: a prompt S[:a] gives a first block anchored at a, seeing the features of S[:a] (strictly before the
anchor); every later round r anchors at prompt length + the tokens produced before it. Greedy decoding is
lossless, so the live tokens are S and every round's draft must equal training's draft at that round's anchor,
which also covers the drafter's static cache across rounds (for sliding-window layers too: their window as a
mask over cache slots must give training's train/block_mask.py rule).
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter, save_drafter
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.eval.report import summarize
from dflashkit.targets.capture import LayerCapture
from dflashkit.targets.loading import load_target, load_target_head
from dflashkit.train.anchors import sample_anchors, sample_generator
from dflashkit.train.data import PAD_MULTIPLE, CollateOptions, pack_sequences
from dflashkit.train.drafter_pass import PassOptions, draft_hidden
from dflashkit.train.evaluate import chain_walk, eval_pack_tokens, evaluate
from dflashkit.train.loss import LossSettings, block_loss
from dflashkit.train.objectives import loss_denominator

from support.tiny_targets import make_tiny_target, tiny_tokenizer

VOCAB, LAYERS, BLOCK, MASK = 96, 4, 4, 95
PROMPT, NEW = 6, 40  # S = 6 random prompt tokens + 40 greedy tokens of the target
TAPS = [0, 2, LAYERS - 1]  # layer L-1 is read from the final norm (targets/capture.py)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("consistency") / "target", vocab=VOCAB, layers=LAYERS)
    tiny_tokenizer(num_words=80).save_pretrained(path)  # load_target wants one; 84 ids < VOCAB
    return path


@pytest.fixture(scope="module")
def setup(target_dir):
    """(target, training head, S, features of S [T, K*H], loss mask of S)."""
    target = load_target(target_dir, dtype=torch.float32)
    head = load_target_head(target_dir, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB - 1, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        seq = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                    min_new_tokens=NEW, do_sample=False, pad_token_id=0)[0]
    assert seq.numel() == PROMPT + NEW and MASK not in seq.tolist()
    with LayerCapture(target, TAPS) as capture:
        hidden, _ = capture(seq[None])
    loss_mask = torch.arange(seq.numel()) >= PROMPT  # the "assistant" span: the target's own continuation
    return target, head, seq, hidden[0], loss_mask


def make_drafter(head, layer_types, sliding_window, steps, setup_, causal=False, **kind):
    """A drafter built as the trainer builds one, briefly trained on S so that drafts are often accepted
    (``kind``: DrafterConfig's architecture fields, e.g. a DFlash2 drafter's)."""
    _, _, seq, hidden, loss_mask = setup_
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(head.config, num_hidden_layers=len(layer_types), block_size=BLOCK,
                                   target_layer_ids=TAPS, mask_token_id=MASK, layer_types=layer_types,
                                   sliding_window=sliding_window, input_embedding_scale=float(head.embedding_scale),
                                   intermediate_size=64, causal=causal, **kind)
    model = build_drafter(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        anchors = sample_anchors(loss_mask, 16, sample_generator(0, step, 0))
        batch = pack_sequences([seq], [loss_mask], [hidden], [anchors], BLOCK, MASK, pad_multiple=PAD_MULTIPLE)
        h = draft_hidden(model, head, batch, block_size=BLOCK, layer_types=cfg.layer_types,
                         sliding_window=cfg.sliding_window, causal=cfg.causal)
        out = block_loss(h, head.lm_head.weight, batch.labels, batch.valid, LossSettings(variant="ce"))
        opt.zero_grad()
        (out.loss_sum / loss_denominator(batch.valid, "ce", 7.0)).backward()
        opt.step()
    return model.eval(), cfg


@torch.no_grad()
def training_drafts(model, cfg, head, seq, hidden, loss_mask, anchors: list[int],
                    backend: str = "dense") -> dict[int, list[int]]:
    """{anchor: argmax tokens at draft positions 1..B-1} exactly as a training / held-out pass computes them
    (backend "flex": the BlockMask a CUDA run trains with, evaluated by eager flex_attention here)."""
    batch = pack_sequences([seq], [loss_mask], [hidden], [torch.tensor(sorted(set(anchors)))], BLOCK, MASK,
                           pad_multiple=PAD_MULTIPLE)
    h = draft_hidden(model, head, batch, block_size=BLOCK, layer_types=cfg.layer_types,
                     sliding_window=cfg.sliding_window, backend=backend, causal=cfg.causal)
    n = len(set(anchors))
    top = F.linear(h[:n], head.lm_head.weight, head.lm_head.bias).float().argmax(-1)
    return {a: top[i].tolist() for i, a in enumerate(sorted(set(anchors)))}


CASES = {"full": (["full_attention", "full_attention"], None, False),
         "sliding": (["sliding_attention", "full_attention"], 3, False),
         "causal": (["full_attention", "full_attention"], None, True)}  # causal inside the block


@pytest.mark.parametrize("case", sorted(CASES))
def test_live_drafts_equal_training_drafts(setup, case, tmp_path):
    target, head, seq, hidden, loss_mask = setup
    layer_types, window, causal = CASES[case]
    model, cfg = make_drafter(head, layer_types, window, steps=60, setup_=setup, causal=causal)
    live = load_drafter(save_drafter(model, tmp_path / "drafter"))  # eval reads the export, as run_eval does
    rounds, checked, multi = [], 0, 0
    for p in (PROMPT, PROMPT + 5, PROMPT + 13):  # prompt S[:p]: the first block is anchored at p
        config = DecodeConfig(mode="chain", max_new_tokens=seq.numel() - p, cuda_graphs=False)
        decoder = SpeculativeDecoder(target, live, config)
        try:
            res = decoder.generate(seq[:p].tolist())
        finally:
            decoder.close()
        assert res.tokens == seq[p:].tolist()  # greedy decoding is lossless: the live tokens are S
        start = p
        for produced, drafts in zip(res.acceptance_lengths, res.drafts):
            rounds.append((start, drafts))
            start += produced
    ref = training_drafts(model, cfg, head, seq, hidden, loss_mask, [a for a, _ in rounds])
    flex = training_drafts(model, cfg, head, seq, hidden, loss_mask, [a for a, _ in rounds], backend="flex")
    assert flex == ref  # the CUDA training mask gives the same drafts as the dense one
    for anchor, drafts in rounds:
        assert drafts == ref[anchor][:len(drafts)], f"anchor {anchor}: live {drafts} != training {ref[anchor]}"
        checked += 1
        multi += len(drafts) == BLOCK - 1 and drafts[0] == seq[anchor + 1].item()
    print(f"{case}: {checked} rounds compared, {multi} with an accepted first draft")
    assert checked >= 20 and multi >= 3  # many rounds, several of them past an accepted draft token


def test_draft_uses_only_context_before_the_anchor(setup):
    """The training draft at anchor a does not change when the features at and after a do (the block sees
    S[:a] only); the live engine cannot see them at all, so this is the convention both sides share."""
    _, head, seq, hidden, loss_mask = setup
    model, cfg = make_drafter(head, ["full_attention"], None, steps=0, setup_=setup)
    a = PROMPT + 10
    noisy = hidden.clone()
    noisy[a:] += torch.randn_like(noisy[a:])
    base = training_drafts(model, cfg, head, seq, hidden, loss_mask, [a])[a]
    with torch.no_grad():
        batch = pack_sequences([seq], [loss_mask], [noisy], [torch.tensor([a])], BLOCK, MASK)
        h = draft_hidden(model, head, batch, block_size=BLOCK, layer_types=cfg.layer_types, sliding_window=None)
        ref = pack_sequences([seq], [loss_mask], [hidden], [torch.tensor([a])], BLOCK, MASK)
        h0 = draft_hidden(model, head, ref, block_size=BLOCK, layer_types=cfg.layer_types, sliding_window=None)
    torch.testing.assert_close(h, h0, rtol=0, atol=1e-6)
    assert F.linear(h[0], head.lm_head.weight).argmax(-1).tolist() == base


def live_report(target, model, seq, tmp_path) -> dict:
    """The eval report of live greedy chain decoding from S's prompt with the drafter's export: lossless (the
    tokens are S), with accepted and rejected drafts both occurring."""
    decoder = SpeculativeDecoder(target, load_drafter(save_drafter(model, tmp_path / "drafter")),
                                 DecodeConfig(mode="chain", max_new_tokens=NEW, cuda_graphs=False))
    try:
        live = decoder.generate(seq[:PROMPT].tolist())
    finally:
        decoder.close()
    assert live.tokens == seq[PROMPT:].tolist()
    assert len(set(live.acceptance_lengths)) >= 2
    return summarize([live], None, BLOCK)


def test_held_out_walk_equals_live_tau(setup, tmp_path):
    """evaluate's tau_walk and walk_accept_k on S are the live tau and per-position acceptance of the eval report
    for the prompt of S (greedy data: the live run visits the same anchors), while tau_sim, a uniform average
    over anchors, is not a live figure."""
    target, head, seq, hidden, loss_mask = setup
    model, cfg = make_drafter(head, ["full_attention"], None, steps=25, setup_=setup)
    dataset = [{"input_ids": seq, "loss_mask": loss_mask, "hidden": hidden}]
    metrics = evaluate(model, head, dataset, [0],
                       PassOptions(block_size=BLOCK, layer_types=cfg.layer_types, sliding_window=None),
                       CollateOptions(block_size=BLOCK, mask_token_id=MASK, num_anchors=8, seed=0))
    report = live_report(target, model, seq, tmp_path)
    assert metrics["eval/tau_walk"] == pytest.approx(report["tau"], abs=1e-12)
    walk = [metrics[f"eval/walk_accept_{k}"] for k in range(1, BLOCK)]
    assert walk == pytest.approx(report["per_position_acceptance"], abs=1e-12)
    print(f"tau_sim {metrics['eval/tau_sim']:.3f}, tau_walk {metrics['eval/tau_walk']:.3f}, live tau "
          f"{report['tau']:.3f}; acc_k {[round(metrics[f'eval/acc_{k}'], 3) for k in range(1, BLOCK)]}, "
          f"live per-position {[round(x, 3) for x in report['per_position_acceptance']]}")


def test_a_dflash2_walk_follows_its_selector_as_live_decoding_does(setup, tmp_path):
    """A DFlash2 drafter proposes its candidate selector's greedy path, live and in vLLM: evaluate's tau_walk and
    walk_accept_k on S are the eval report's for it, and the argmax walk (eval/tau_walk_argmax) is kept beside
    it. The successor codebook is drawn at random, so the path departs from the argmax: were the walk the argmax
    one, the two figures would not differ and the live comparison would fail."""
    target, head, seq, hidden, loss_mask = setup
    model, cfg = make_drafter(head, ["full_attention"], None, steps=25, setup_=setup, architecture="dflash2",
                              conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)
    with torch.no_grad():
        selector = model.candidate_selector
        selector.successor_codebook.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        selector.predecessor_codebook.mul_(50.0)
    dataset = [{"input_ids": seq, "loss_mask": loss_mask, "hidden": hidden}]
    passes = PassOptions(block_size=BLOCK, layer_types=cfg.layer_types, sliding_window=None, extra_term=False)
    metrics = evaluate(model, head, dataset, [0], passes,  # extra_term off: the walk's rule regardless
                       CollateOptions(block_size=BLOCK, mask_token_id=MASK, num_anchors=8, seed=0))
    report = live_report(target, model, seq, tmp_path)
    assert metrics["eval/tau_walk"] == pytest.approx(report["tau"], abs=1e-12)
    walk = [metrics[f"eval/walk_accept_{k}"] for k in range(1, BLOCK)]
    assert walk == pytest.approx(report["per_position_acceptance"], abs=1e-12)
    argmax = [metrics[f"eval/walk_argmax_accept_{k}"] for k in range(1, BLOCK)]
    assert argmax != walk and metrics["eval/tau_walk_argmax"] != metrics["eval/tau_walk"]
    print(f"DFlash2: selector walk {metrics['eval/tau_walk']:.3f} {[round(x, 3) for x in walk]}, argmax walk "
          f"{metrics['eval/tau_walk_argmax']:.3f} {[round(x, 3) for x in argmax]}, live {report['tau']:.3f}")


def test_chain_walk_rules():
    """Two turns (positions 2..6 and 10..12; their end-of-turn tokens at 7 and 13): rounds start at each turn's
    first token, move past the accepted run and the bonus token, and stop at the end-of-turn token."""
    anchors = [2, 3, 4, 5, 6, 10, 11, 12]
    runs = {2: 1, 3: 0, 4: 3, 5: 0, 6: 1, 10: 3, 11: 0, 12: 1}
    rounds, tokens, accepted = chain_walk(anchors, [runs[a] for a in anchors], block_size=4)
    # turn 1: a=2 (run 1, 2 tokens) -> a=4 (run 3 reaches the end token at 7: 3 tokens, no bonus) -> done
    # turn 2: a=10 (run 3 reaches 13: 3 tokens) -> done
    assert (rounds, tokens, accepted) == (3, 8, [3, 2, 2])


class Prefixes(list):
    """Held-out samples as a dataset with ``lengths`` (what packing reads): prefixes of S, whose features are the
    prefixes of S's features (the target is causal)."""

    def __init__(self, seq, hidden, loss_mask, cuts):
        super().__init__({"input_ids": seq[:n], "loss_mask": loss_mask[:n], "hidden": hidden[:n]} for n in cuts)
        self.lengths = list(cuts)


def test_held_out_packs_give_the_numbers_of_one_sample_per_pass(setup):
    """evaluate packs the held-out samples (batch_tokens) and reads each pack once for both of its passes; the
    metrics are sums over blocks and the anchors are keyed by sample index, so packing changes nothing but
    float rounding: the same loss, accuracies, tau_sim, and the same chain walk (tau_walk, acceptance)."""
    _, head, seq, hidden, loss_mask = setup
    model, cfg = make_drafter(head, ["full_attention"], None, steps=25, setup_=setup)
    dataset = Prefixes(seq, hidden, loss_mask, [PROMPT + NEW, 40, 33, 27, 20])

    passes = []
    model.register_forward_hook(lambda *_: passes.append(1))  # one call per drafter pass

    def run(batch_tokens):
        passes.clear()
        metrics = evaluate(model, head, dataset, list(range(len(dataset))),
                           PassOptions(block_size=BLOCK, sliding_window=None, layer_types=cfg.layer_types),
                           CollateOptions(block_size=BLOCK, mask_token_id=MASK, num_anchors=8, seed=0),
                           batch_tokens=batch_tokens)
        return metrics, len(passes)

    (alone, n0), (paired, n1), (whole, n2) = run(0), run(80), run(4096)  # one sample a pass; 3 packs; 1 pack
    assert (n0, n1, n2) == (10, 6, 2)  # two passes (fixed anchors, the walk) per pack
    assert eval_pack_tokens(4096, 2048) == 2048 and eval_pack_tokens(4096, None) == 4096
    assert eval_pack_tokens(0, 2048) == 0  # a run that trains one sequence at a time evaluates one at a time
    assert alone["eval/tau_walk"] > 1.2  # drafts are accepted, so the walk compares real runs
    for packed in (paired, whole):
        assert sorted(packed) == sorted(alone)
        for key, value in alone.items():
            if key.startswith(("eval/tau_walk", "eval/walk_accept")):
                assert packed[key] == value, key  # counts of accepted drafts: exact
            else:
                assert packed[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_compiled_layers_are_evaluated_through_the_training_graphs(setup, monkeypatch, device):
    """With compiled layers in one process, evaluate's passes run in grad mode through the graphs a training
    step compiled: no graph is compiled for them, the numbers are the eager model's, and the model's mode and
    gradients are as before. In no-grad mode (the form before) the same evaluation compiles its own graphs.
    On CUDA with the fused loss; the testbed's run logs its recompilations (lab/NOTEBOOK.md)."""
    import copy

    from dflashkit.train import evaluate as evaluate_module
    from dflashkit.train.drafter_pass import compile_layers, forward_blocks, layers_compiled

    _, head, seq, hidden, loss_mask = setup
    eager, cfg = make_drafter(head, ["full_attention", "full_attention"], None, steps=10, setup_=setup)
    head, eager = copy.deepcopy(head).to(device), eager.to(device)
    cuda = device == "cuda"
    # dense masks on CUDA too: the compiled flex kernel wants head dims of 16 or more (this drafter's are 8)
    passes = PassOptions(block_size=BLOCK, sliding_window=None, layer_types=cfg.layer_types, backend="dense",
                         loss=LossSettings(fused=cuda))
    dataset = Prefixes(seq, hidden, loss_mask, [PROMPT + NEW, 40, 33])
    held_out = CollateOptions(block_size=BLOCK, mask_token_id=MASK, num_anchors=8, seed=0)
    options = dict(batch_tokens=4096, device=torch.device(device))
    want = evaluate(eager, head, dataset, list(range(3)), passes, held_out, **options)
    model = copy.deepcopy(eager).train()
    assert not layers_compiled(model)
    torch._dynamo.reset()
    compile_layers(model)
    assert layers_compiled(model)
    for cuts in ([PROMPT + NEW, 33], [40, 27]):  # training steps: the layers' grad-mode graphs (dynamic sizes)
        anchors = [sample_anchors(loss_mask[:n], 8, sample_generator(0, n, 0)) for n in cuts]
        batch = pack_sequences([seq[:n] for n in cuts], [loss_mask[:n] for n in cuts], [hidden[:n] for n in cuts],
                               anchors, BLOCK, MASK, pad_multiple=PAD_MULTIPLE).to(device)
        forward_blocks(model, head, batch, passes).loss_sum.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    compiled_before = layer_graphs()
    assert compiled_before >= 2  # the first layer's input without a gradient, the others' with one
    from dflashkit.train import loss as loss_module

    asked = []  # need_grad of every loss engine call: the evaluation computes no gradient of the states
    engine = loss_module.chunked_logit_statistics
    need_grad = inspect.signature(engine).bind  # the argument by its name, however the call passes it

    def recording(*args, **kwargs):
        asked.append(need_grad(*args, **kwargs).arguments["need_grad"])
        return engine(*args, **kwargs)

    monkeypatch.setattr(loss_module, "chunked_logit_statistics", recording)
    got = evaluate(model, head, dataset, list(range(3)), passes, held_out, **options)
    assert asked and not any(asked)
    monkeypatch.setattr(loss_module, "chunked_logit_statistics", engine)
    assert layer_graphs() == compiled_before  # no layer graph compiled for the evaluation
    assert model.training and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    monkeypatch.setattr(evaluate_module, "training_graphs", lambda *_: False)  # the no-grad form compiles anew
    evaluate(model, head, dataset, list(range(3)), passes, held_out, **options)
    assert layer_graphs() > compiled_before


def layer_graphs() -> int:
    """The compiled graphs of the drafter's decoder layers (dynamo's cache entries of their forward); the fused
    loss's own small graphs (CUDA) are not counted: they may specialise again on a new chunk offset."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from dflashkit.drafter.modeling_dflash import DFlashDecoderLayer

    return len(_debug_get_cache_entry_list(DFlashDecoderLayer.forward.__code__))
