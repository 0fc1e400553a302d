"""DFlash2 drafters against the reference (PyPI `dflash` 0.1.0, `DFlash2DraftModel`): strict loading, the same
hidden states, logits and greedy proposals; the in-block convolution acts on each block alone (fp32, CPU)."""

import json

import dflash.model as ref  # the reference package: a dev dependency, so a missing one fails
import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter, save_drafter
from dflashkit.drafter.modeling_dflash2 import grouped_dynamic_causal_conv

from support.exports import forward_without_dflashkit, rel_err

TARGET = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=10, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=320, rope_theta=5e5)
DFLASH2 = dict(architecture="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=12, selector_top_k=6)


def dflash2_drafter(block_size=6, **kw):
    """A DFlash2 drafter whose convolutions and selector are not at their identity start (random weights)."""
    cfg = DrafterConfig.for_target(TARGET, block_size=block_size, mask_token_id=319, num_hidden_layers=2,
                                   **{**DFLASH2, **kw})
    model = build_drafter(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return cfg, model


def _inputs(cfg, ctx=7, start=0, q=None):
    q = q or cfg.block_size
    return dict(position_ids=torch.arange(start, start + ctx + q)[None],
                noise_embedding=torch.randn(1, q, cfg.hidden_size),
                target_hidden=torch.randn(1, ctx, cfg.num_taps * cfg.hidden_size))


def test_export_loads_strictly_into_the_reference_with_same_logits_and_proposals(tmp_path):
    cfg, ours = dflash2_drafter()
    save_drafter(ours, tmp_path / "d")
    theirs, info = ref.DFlash2DraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32,
                                                         output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    theirs.eval()
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with torch.no_grad():
        for ctx in (3, 11):
            x = _inputs(cfg, ctx=ctx)
            a, b = ours(**x), theirs(**x)
            assert rel_err(a, b) <= 1e-6
            assert rel_err(ours.compute_logits(a, head), theirs.compute_logits(b, head)) <= 1e-6
            anchor = torch.tensor([17])
            mine, mine_cands, _ = ours.propose(a[:, 1:], anchor, head)
            want, want_cands, _ = theirs.propose(b[:, 1:], anchor, head, 0.0)
            assert torch.equal(mine, want)
            assert torch.equal(mine_cands.sort(-1).values, want_cands.sort(-1).values)


def test_cached_short_blocks_match_the_reference(tmp_path):
    """Two rounds with a cropped DynamicCache, the second with a block shorter than block_size (end of a reply)."""
    cfg, ours = dflash2_drafter(block_size=5)
    save_drafter(ours, tmp_path / "d")
    theirs = ref.DFlash2DraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    caches, start = [DynamicCache(), DynamicCache()], 0
    with torch.no_grad():
        for ctx, q in ((6, 5), (3, 2)):
            x = _inputs(cfg, ctx=ctx, start=start, q=q)
            outs = [m(**x, past_key_values=c, use_cache=True) for m, c in zip((ours, theirs), caches)]
            assert rel_err(*outs) <= 1e-6
            start += ctx
            for c in caches:
                c.crop(start - c.get_seq_length())


def test_convolution_acts_within_each_packed_block():
    """N blocks end to end (training's layout) = each block through the reference's convolution alone."""
    torch.manual_seed(1)
    n, b, h, g, k = 5, 4, 32, 8, 3
    hidden, dynamic = torch.randn(1, n * b, h), torch.randn(1, n * b, k, h // g)
    base = torch.randn(k, h)
    packed = grouped_dynamic_causal_conv(hidden, dynamic, base, g, b)
    for i in range(n):
        sl = slice(i * b, (i + 1) * b)
        alone = ref._grouped_dynamic_convolve(hidden[:, sl], dynamic[:, sl], base, g)
        assert torch.equal(packed[:, sl], alone), i
    with pytest.raises(ValueError, match="whole number of blocks"):
        grouped_dynamic_causal_conv(hidden[:, :6], dynamic[:, :6], base, g, b)


def test_fresh_dflash2_drafter_starts_as_the_dflash_drafter():
    """Identity convolutions and a zero successor codebook: the same states as DFlash, proposals = argmax."""
    cfg = DrafterConfig.for_target(TARGET, block_size=6, mask_token_id=319, num_hidden_layers=2, **DFLASH2)
    torch.manual_seed(0)
    two = build_drafter(cfg).eval()
    one = build_drafter(DrafterConfig.for_target(TARGET, block_size=6, mask_token_id=319,
                                                 num_hidden_layers=2)).eval()
    missing = one.load_state_dict(two.state_dict(), strict=False)
    assert not missing.missing_keys
    x = _inputs(cfg)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with torch.no_grad():
        a, b = two(**x), one(**x)
        assert torch.equal(a, b)
        tokens, _, _ = two.propose(a[:, 1:], torch.tensor([3]), head)
        assert torch.equal(tokens, torch.argmax(head(a[:, 1:]), -1))


def test_config_and_reload(tmp_path):
    cfg, ours = dflash2_drafter()
    save_drafter(ours, tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    assert data["architectures"] == ["DFlash2DraftModel"]
    assert data["auto_map"] == {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}
    assert {k: data["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k")} == {k: v for k, v in DFLASH2.items()
                                                                         if k != "architecture"}
    assert (tmp_path / "d" / "modeling_dflash2.py").is_file() and (tmp_path / "d" / "modeling_dflash.py").is_file()
    back = load_drafter(tmp_path / "d")
    assert back.dflash.architecture == "dflash2" and back.dflash.selector_top_k == 6
    x = _inputs(cfg)
    with torch.no_grad():
        assert torch.equal(back(**x), ours(**x))
    plain = DrafterConfig.for_target(TARGET, block_size=6, mask_token_id=319).to_json_dict()
    assert plain["architectures"] == ["DFlashDraftModel"] and "selector_rank" not in plain["dflash_config"]
    with pytest.raises(ValueError, match="conv_group_size=24 must divide hidden_size=64"):
        DrafterConfig.for_target(TARGET, mask_token_id=319, **{**DFLASH2, "conv_group_size": 24})
    del data["dflash_config"]["selector_top_k"]
    with pytest.raises(ValueError, match="selector_top_k"):
        DrafterConfig.from_json_dict(data)


def test_export_loads_with_automodel_without_dflashkit(tmp_path):
    cfg, ours = dflash2_drafter()
    save_drafter(ours, tmp_path / "d")
    x = _inputs(cfg, ctx=6)
    with torch.no_grad():
        expected = ours(**x)
    assert rel_err(forward_without_dflashkit(tmp_path / "d", x, tmp_path, "DFlash2DraftModel"), expected) <= 1e-6


def test_the_base_convolution_kernels_are_never_weight_decayed():
    """They start as the identity tap: decay would pull each layer's convolutions towards zero (AdamW and Muon)."""
    from dflashkit.train.muon import muon_param_groups
    from dflashkit.train.setup_drafter import param_groups

    model = build_drafter(DrafterConfig.for_target(TARGET, block_size=4, mask_token_id=319, num_hidden_layers=1,
                                                   **DFLASH2))
    names = {id(p): n for n, p in model.named_parameters()}
    for groups in (param_groups(model, 0.1), muon_param_groups(model, lr=1e-3, muon_lr=0.0, weight_decay=0.1)):
        decayed = {names[id(p)] for g in groups if g["weight_decay"] for p in g["params"]}
        kernels = {n for n in names.values() if n.endswith("base_kernel")}
        assert kernels and not kernels & decayed and "layers.0.self_attn.q_proj.weight" in decayed


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_codebooks_learn_at_their_own_multiple_of_the_lr(optimizer):
    """``selector_codebook_lr_scale``: the two codebooks, and only they, sit in one AdamW group whose peak lr is
    the multiple (decayed as before), the schedule scales it like the others, and a first step moves each drawn
    row by about that lr (Adam's first step is lr * sign(g)); at 1 the groups are those of before."""
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.setup_drafter import build_optimizer
    from dflashkit.train.train_step import set_lr

    model = build_drafter(DrafterConfig.for_target(TARGET, block_size=4, mask_token_id=319, num_hidden_layers=1,
                                                   **DFLASH2))
    names = {id(p): n for n, p in model.named_parameters()}
    books = {n for n in names.values() if n.endswith("_codebook")}
    assert books == {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}

    def optimizer_for(scale):
        cfg = TrainConfig(optimizer=optimizer, lr=1e-3, weight_decay=0.1, selector_codebook_lr_scale=scale)
        return build_optimizer(cfg, model, "ddp")

    plain, scaled = optimizer_for(1.0), optimizer_for(10.0)
    for opt in (plain, scaled):  # every parameter in exactly one group
        assert sorted(names[id(p)] for g in opt.param_groups for p in g["params"]) == sorted(names.values())
    (group,) = [g for g in scaled.param_groups if {names[id(p)] for p in g["params"]} & books]
    assert {names[id(p)] for p in group["params"]} == books and not group.get("use_muon")
    assert group["base_lr"] == pytest.approx(1e-2) and group["weight_decay"] == 0.1
    (before,) = [g for g in plain.param_groups if {names[id(p)] for p in g["params"]} & books]
    assert before.get("base_lr", 1e-3) == 1e-3 and before["weight_decay"] == 0.1
    # the layout of before: AdamW's decayed / not decayed; Muon's matrices / decayed tables / not decayed
    assert len(plain.param_groups) == {"adamw": 2, "muon": 3}[optimizer]
    set_lr(scaled, 1e-3, 0.5)
    assert group["lr"] == pytest.approx(5e-3) and all(
        g["lr"] == pytest.approx(5e-4) for g in scaled.param_groups if g is not group)

    selector = model.candidate_selector
    with torch.no_grad():
        selector.successor_codebook.normal_(0.0, 0.02)
    rows, pull = torch.tensor([3, 7, 11]), torch.randn(3, selector.rank)
    old = selector.successor_codebook.detach().clone()
    scaled.zero_grad(set_to_none=True)
    (selector.successor_codebook[rows] * pull).sum().backward()  # the rows' gradient is ``pull``
    scaled.step()
    decayed = -5e-3 * 0.1 * old  # AdamW's decoupled decay at the group's lr, every row alike
    moved = selector.successor_codebook.detach() - old - decayed
    assert torch.allclose(moved[rows], -5e-3 * pull.sign(), rtol=1e-3)
    moved[rows] = 0
    assert moved.abs().max() < 1e-7  # float32 rounding of rows ~0.02; a step would be 5e-3


def test_selector_scores_under_autocast_equal_those_of_float32_codebook_rows(monkeypatch):
    """Under bf16 autocast (mixed-precision training) the successor codebook's rows are gathered already in bf16
    (``codebook_rows``): the scores and every gradient are bit for bit those of F.embedding's float32 rows, which
    the matmul cast; outside autocast the rows are F.embedding's."""
    import torch.nn.functional as F

    from dflashkit.drafter import modeling_dflash2

    _, model = dflash2_drafter()
    selector = model.candidate_selector
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(9, 5, TARGET.hidden_size, generator=g)
    unary = torch.randn(9, 5, 6, generator=g)
    candidates = torch.randint(0, 40, (9, 5, 6), generator=g)  # repeated ids: rows whose gradients add up
    prev = torch.randint(0, 320, (9, 5), generator=g)
    weights = torch.randn(9, 5, 6, generator=g)

    def scores_and_grads():
        selector.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = selector.pair_scores(h, unary, candidates, prev)
        (scores.float() * weights).sum().backward()
        return [scores.detach(), h.grad] + [p.grad for p in selector.parameters()]

    assert modeling_dflash2.codebook_rows(candidates, selector.successor_codebook).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert modeling_dflash2.codebook_rows(candidates, selector.successor_codebook).dtype == torch.bfloat16
    new = scores_and_grads()
    monkeypatch.setattr(modeling_dflash2, "codebook_rows", lambda ids, codebook: F.embedding(ids, codebook))
    old = scores_and_grads()
    assert all(torch.equal(a, b) for a, b in zip(new, old)) and len(new) == 5
    assert all(t.abs().sum() > 0 for t in new)  # scores, the hidden states' and every parameter's gradient


def test_convolution_under_autocast_runs_in_its_dtype_and_keeps_no_float32_activation():
    """Mixed-precision training hands the convolution float32 (the norm's float32 weight): ``prepare`` convolves in
    the autocast dtype, as the sublayer's matmuls read it and a bf16 drafter serves, so nothing activation-sized it
    keeps for the backward is float32; its result is the float32 convolution of the bf16 input to bf16 rounding."""
    from dflashkit.drafter.modeling_dflash2 import GroupedDynamicCausalConv

    g = torch.Generator().manual_seed(5)
    conv = GroupedDynamicCausalConv(64, 3, 16)
    with torch.no_grad():
        conv.base_kernel.add_(torch.randn(conv.base_kernel.shape, generator=g) * 0.3)
        conv.kernel_projection.weight.normal_(0, 0.3, generator=g)
    x = torch.randn(2, 24, 64, generator=g, requires_grad=True)  # float32, 3 blocks of 8
    activation = x.numel()
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, dynamic = conv.prepare(x, 8)
    assert out.dtype == dynamic.dtype == torch.bfloat16
    big = [t for t in kept if t.numel() >= activation]
    assert big and all(t.dtype == torch.bfloat16 for t in big)
    out.float().square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and conv.base_kernel.grad.abs().sum() > 0

    xb = x.detach().to(torch.bfloat16).float()
    dyn = (xb @ conv.kernel_projection.weight.detach().to(torch.bfloat16).float().T).to(torch.bfloat16).float()
    dyn = dyn.view(2, 24, 2, 3, 4)[..., 0, :, :]
    expected = grouped_dynamic_causal_conv(xb, dyn, conv.base_kernel.detach()[0].to(torch.bfloat16).float(), 16, 8)
    assert rel_err(out.float(), expected) < 2e-2
    with torch.no_grad():  # outside autocast: float32 throughout, as before
        assert conv.prepare(x, 8)[0].dtype == torch.float32
