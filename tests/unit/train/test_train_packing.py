"""Packing several sequences into one micro-batch computes exactly what one pass per sequence computes: the mask
element by element, the drafter's output and logits per block, the loss, its gradients, and whole training runs."""


from dataclasses import replace

import pytest
import torch

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.train.block_mask import TILE, block_tiles, dense_block_mask, flex_block_mask
from dflashkit.train.data import CollateOptions, collate_blocks, pack_order, pack_sequences
from dflashkit.train.drafter_pass import PassOptions, compile_layers, forward_blocks
from dflashkit.train.loss import LossSettings, block_loss
from dflashkit.train.objectives import loss_denominator

from support.packed_blocks import Head, drafter_pass, make_samples, tile_truth, tiny_drafter


def loop_reference(anchors, starts, L, B, window=None):
    """Written from the rules, one (query, key) pair at a time; anchors/starts are packed context indices."""
    n_q = len(anchors) * B
    out = torch.zeros(n_q, L + n_q, dtype=torch.bool)
    for n, (a, s) in enumerate(zip(anchors, starts)):
        for i in range(B):
            qpos = a + i
            for j in range(L):
                ok = s <= j < a
                if window is not None:
                    ok = ok and qpos - j < window
                out[n * B + i, j] = ok
            for k in range(B):
                ok = window is None or (k <= i and i - k < window)
                out[n * B + i, L + n * B + k] = ok
    return out


def packed_anchors(lens, per_seq, seed):
    g = torch.Generator().manual_seed(seed)
    anchors, starts, off = [], [], 0
    for n in lens:
        a = torch.randperm(n, generator=g)[:per_seq].sort().values
        anchors += (a + off).tolist()
        starts += [off] * len(a)
        off += n
    return anchors, starts, off


MASK_CASES = [([9, 14, 5], 4, None), ([20, 13], 5, 3), ([7, 30, 11, 2], 6, 8), ([25], 4, 1)]


@pytest.mark.parametrize("lens,B,window", MASK_CASES)
def test_packed_mask_equals_element_loop(lens, B, window):
    anchors, starts, L = packed_anchors(lens, 4, seed=len(lens))
    anchors, starts = anchors + [0, 0], starts + [0, 0]  # two padding blocks: they see only themselves
    got = dense_block_mask(torch.tensor(anchors), L + 3, B, window, torch.tensor(starts))[0, 0]
    assert torch.equal(got, loop_reference(anchors, starts, L + 3, B, window))
    assert got.any(-1).all()  # no query row is empty


@pytest.mark.parametrize("lens,B,window", [([300, 200, 140], 16, None), ([300, 200, 140], 16, 40),
                                           ([300, 500], 12, None), ([256, 256], 16, None), ([100, 37, 250], 10, 7)])
def test_flex_tiles_and_numbers(lens, B, window):
    """The closed-form tiles hold every visible pair, mark full only all-visible tiles (exactly the truth in these
    cases), and flex_attention with them gives SDPA's numbers on the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    anchors, starts, L = packed_anchors(lens, 40, seed=B)
    a, s = torch.tensor(anchors), torch.tensor(starts)
    dense = dense_block_mask(a, L, B, window, s)[0, 0]
    any_t, full_t = block_tiles(a, L, B, window, s)
    truth_any, truth_full = tile_truth(dense)
    assert torch.equal(any_t, truth_any) and torch.equal(full_t, truth_full)
    assert full_t.any() or window is not None or L % TILE  # the full-tile path is exercised
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, dense.shape[0], 8, generator=g)
    k, v = torch.randn(2, 1, 2, dense.shape[1], 8, generator=g)
    got = flex_attention(q, k, v, block_mask=flex_block_mask(a, L, B, window, s))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_pack_order_is_greedy_and_keeps_the_order():
    lengths = {0: 5, 1: 3, 2: 9, 3: 2, 4: 20, 5: 1, 6: 4}
    order = [3, 0, 2, 1, 4, 6, 5]
    assert pack_order(order, lengths, 10) == [[3, 0], [2], [1], [4], [6, 5]]  # 20 > budget: alone
    assert pack_order(order, lengths, 10, max_length=8) == [[3, 0], [2], [1], [4], [6, 5]]
    assert pack_order(order, lengths, 16, max_length=8) == [[3, 0, 2], [1, 4, 6, 5]]  # 9 and 20 count as 8
    assert pack_order(order, lengths, 0) == [[i] for i in order]
    packs = pack_order(list(range(7)), lengths, 12)
    assert [i for p in packs for i in p] == list(range(7))
    assert all(sum(lengths[i] for i in p) <= 12 or len(p) == 1 for p in packs)


# --------------------------------------------------------------------------- drafter passes
@pytest.mark.parametrize("variant", ["ce", "dpace", "kl"])
@pytest.mark.parametrize("layer_types,window", [(["full_attention"] * 2, None),
                                                (["sliding_attention", "full_attention"], 3)])
def test_packed_micro_batch_equals_per_sequence_passes(layer_types, window, variant):
    torch.manual_seed(0)
    V, H, B = 40, 32, 4
    model, head = tiny_drafter(V, H, B, layer_types, window), Head(V, H, scale=1.5).double()
    samples = make_samples([14, 9, 21], V, H, seed=1)
    opts = CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2,
                          use_last_hidden=variant == "kl")
    packed = collate_blocks(samples, opts)  # padded to 128-token tiles
    assert packed.ctx_len % TILE == 0 and packed.anchors.numel() * B % TILE == 0
    assert packed.num_tokens == 44 and packed.context_offsets == [0, 14, 23, 44]
    out, hidden = drafter_pass(model, head, packed, B, layer_types, window, variant)
    (out.loss_sum / loss_denominator(packed.valid, variant, 7.0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    sums, denom, blocks = 0.0, 0.0, 0
    for s, sample in enumerate(samples):
        alone = collate_blocks([sample], opts, pad_multiple=1)  # the same anchors: keyed by (seed, epoch, index)
        lo, hi = packed.block_offsets[s], packed.block_offsets[s + 1]
        assert torch.equal(packed.anchors[lo:hi] - packed.context_offsets[s], alone.anchors)
        for name in ("labels", "valid", "block_ids"):
            want = getattr(alone, name).view(alone.anchors.numel(), -1)
            assert torch.equal(getattr(packed, name).view(packed.anchors.numel(), -1)[lo:hi], want), name
        one, one_hidden = drafter_pass(model, head, alone, B, layer_types, window, variant)
        # per block: the drafter's output, hence the logits, and the loss of the sequence's blocks
        torch.testing.assert_close(hidden[lo:hi], one_hidden, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(head.lm_head(hidden[lo:hi, 1:]), head.lm_head(one_hidden[:, 1:]),
                                   rtol=1e-6, atol=1e-7)
        teacher = packed.last_hidden[packed.teacher_index[lo:hi]] if variant == "kl" else None
        part = block_loss(hidden[lo:hi, 1:], head.lm_head.weight, packed.labels[lo:hi], packed.valid[lo:hi],
                          LossSettings(variant=variant), teacher_hidden=teacher)
        torch.testing.assert_close(part.loss_sum, one.loss_sum, rtol=1e-6, atol=1e-7)
        sums, blocks = sums + one.loss_sum, blocks + int(one.blocks)
        denom = denom + loss_denominator(alone.valid, variant, 7.0)
        one.loss_sum.backward()  # accumulates the unnormalised per-sequence gradients
    # padding blocks add nothing; the packed loss is the unpacked loss; so are its gradients
    assert int(out.blocks) == blocks and not packed.valid[packed.block_offsets[-1]:].any()
    torch.testing.assert_close(out.loss_sum / loss_denominator(packed.valid, variant, 7.0), sums / denom,
                               rtol=1e-7, atol=1e-8)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad / denom, rtol=1e-6, atol=1e-8, msg=n)


def test_pack_sequences_layout():
    ids = [torch.arange(100, 106), torch.arange(200, 204)]
    mask = [torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.bool), torch.tensor([1, 1, 1, 0], dtype=torch.bool)]
    hidden = [torch.randn(6, 2), torch.randn(4, 2)]
    p = pack_sequences(ids, mask, hidden, [torch.tensor([1, 4]), torch.tensor([1])], 3, 7, pad_multiple=4)
    assert p.anchors.tolist() == [1, 4, 7, 0] and p.context_start.tolist() == [0, 0, 6, 0]  # + one padding block
    assert p.block_ids.view(4, 3).tolist() == [[101, 7, 7], [104, 7, 7], [201, 7, 7], [7, 7, 7]]
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0] + [1, 2, 3, 4, 5, 6, 1, 2, 3, 0, 1, 2]
    assert p.labels.tolist() == [[102, 103], [105, 0], [202, 203], [0, 0]]
    assert p.valid.tolist() == [[True, True], [True, False], [True, False], [False, False]]  # 203: outside the mask
    assert p.teacher_index.tolist() == [[1, 2], [4, 5], [7, 8], [0, 0]]
    assert p.target_hidden.shape == (1, 12, 2) and not p.target_hidden[0, 10:].any()
    assert p.block_offsets == [0, 2, 3] and p.num_tokens == 10 and p.ctx_len == 12


# --------------------------------------------------------------------------- whole runs
@pytest.fixture(scope="module")
def even_shards(tmp_path_factory):
    from support.shards import make_shards
    from support.tiny_targets import make_tiny_target

    root = tmp_path_factory.mktemp("even")
    target = make_tiny_target(root / "target")
    return make_shards(root / "shards", target, num_samples=12, lengths=(32, 32))


# anchor_density 0: num_anchors per sequence; 0.2: per token. muon: the testbed recipe's optimizer
@pytest.mark.parametrize("anchor_density,optimizer", [(0.0, "adamw"), (0.2, "adamw"), (0.0, "muon")])
def test_packed_run_equals_unpacked_run(even_shards, tmp_path, anchor_density, optimizer):
    """12 samples of 32 tokens, 2 held out: packing 3 per micro-batch (G=1) trains, step by step, on the same
    samples with the same anchors as one sequence per micro-batch with G=3, so every logged loss agrees."""
    from accelerate.state import AcceleratorState, GradientState

    from dflashkit.train.recipe import load_config
    from dflashkit.train.trainer import train

    from support.training import tiny_overrides, train_losses

    summaries = {}
    for name, kw in (("packed", dict(micro_batch_tokens=96, grad_accum=1, epochs=1)),
                     ("unpacked", dict(micro_batch_tokens=0, grad_accum=3, epochs=1))):
        summaries[name] = train(load_config(None, [], **tiny_overrides(even_shards, tmp_path / name, **kw,
                                                                       anchor_density=anchor_density,
                                                                       optimizer=optimizer)))
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    a, b = train_losses(tmp_path / "packed"), train_losses(tmp_path / "unpacked")
    assert sorted(a) == sorted(b) == list(range(1, 5))  # ceil(10 / 3) steps
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5, abs=1e-6), step
    for key in ("eval/loss", "eval/tau_sim"):
        assert summaries["packed"][key] == pytest.approx(summaries["unpacked"][key], rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flex", "split"])
def test_packed_compiled_flex_equals_dense_on_cuda(backend):
    """On the GPU the closed-form BlockMask tiles drive the compiled flex_attention kernels (and the fused loss):
    a packed micro-batch (two shapes, so the compiled code follows a new one) gives the dense, eager loss and
    gradients; so does the split form (train/split_attention.py: its context part through flex_attention)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    V, H, B = 64, 64, 8
    types = ["sliding_attention", "full_attention"]
    cfg = DrafterConfig(hidden_size=H, num_target_layers=4, vocab_size=V, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, target_layer_ids=[0, 2],
                        block_size=B, mask_token_id=V - 1, layer_types=types, sliding_window=5)
    dense_model = build_drafter(cfg).cuda()
    flex_model = build_drafter(cfg).cuda()
    flex_model.load_state_dict(dense_model.state_dict())
    compile_layers(flex_model)  # as the trainer compiles them
    head = Head(V, H).cuda()
    for lens in ([200, 173, 61], [90, 300]):
        samples = [{**s, "hidden": s["hidden"].float()} for s in make_samples(lens, V, H, seed=len(lens))]
        options = CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=24, seed=0)
        batch = collate_blocks(samples, options).to("cuda")
        outs = {}
        for name, model in (("dense", dense_model), ("flex", flex_model)):
            model.zero_grad()
            out = forward_blocks(model, head, batch,
                                 PassOptions(block_size=B, layer_types=types, sliding_window=5,
                                             backend="dense" if name == "dense" else backend,
                                             loss=LossSettings(fused=name == "flex")))  # + the compiled logit kernels
            out.loss_sum.backward()
            outs[name] = (out.loss_sum.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        assert outs["flex"][0] == pytest.approx(outs["dense"][0], rel=1e-4)
        for n, g in outs["dense"][1].items():
            torch.testing.assert_close(outs["flex"][1][n], g, rtol=2e-3, atol=2e-5, msg=n)


@pytest.mark.parametrize("first", [([100, 90], 40), ([100, 90], 24)], ids=["sizes_apart", "sizes_equal"])
def test_compiled_layers_follow_new_shapes_without_recompiling(first):
    """compile_layers (the trainer's compile) builds each layer's graph for symbolic sizes at its first call: a
    second packed micro-batch of other sizes runs the same graphs (no recompilation, which torch.compile's default
    would do) and the loss and gradients equal the eager model's. CPU, dense masks, inductor's C++ backend. Also
    when the first micro-batch's context and block positions happen to have one size (both are padded to 128):
    compiled with duck sizing (PyTorch's default) the graphs assumed them equal and the second micro-batch
    compiled them again."""
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(use_duck_shape=True):  # the default, restored after; compile_layers turns it off
        compiled_layers_follow_new_shapes(first, counters)


def eager_and_uncompiled_twin(V: int, H: int, B: int, counters):
    """Two 2-layer drafters with the same weights, dynamo's state and counters fresh (the second to compile)."""
    torch._dynamo.reset()
    counters.clear()
    eager = tiny_drafter(V, H, B, ["full_attention", "full_attention"], None).float()
    twin = tiny_drafter(V, H, B, ["full_attention", "full_attention"], None).float()
    twin.load_state_dict(eager.state_dict())
    return eager, twin


def compiled_layers_follow_new_shapes(first, counters) -> None:
    V, H, B = 32, 16, 4
    eager, compiled = eager_and_uncompiled_twin(V, H, B, counters)
    compile_layers(compiled)
    head = Head(V, H)
    graphs = []
    # context / block tokens after padding: 256 / 384 (24 anchors: 256 / 256), then 384 / 512
    for k, (lens, anchors) in enumerate((first, ([150, 120, 60], 40))):
        samples = [{**s, "hidden": s["hidden"].float()} for s in make_samples(lens, V, H, seed=len(lens))]
        batch = collate_blocks(samples, CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=anchors, seed=0))
        if k == 0:
            assert (batch.ctx_len == batch.block_ids.shape[1]) == (anchors == 24)
        outs = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            model.zero_grad()
            out = forward_blocks(model, head, batch,
                                 PassOptions(block_size=B, layer_types=["full_attention"] * 2, sliding_window=None))
            out.loss_sum.backward()
            outs[name] = (out.loss_sum.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        graphs.append(counters["stats"]["unique_graphs"])
        assert outs["compiled"][0] == pytest.approx(outs["eager"][0], rel=1e-5)
        for n, g in outs["eager"][1].items():
            torch.testing.assert_close(outs["compiled"][1][n], g, rtol=1e-4, atol=1e-6, msg=n)
    assert batch.ctx_len == 384 and batch.block_ids.shape[1] == 512
    assert graphs[0] >= 1 and graphs[1] == graphs[0], graphs  # the new shapes added no graph
    torch._dynamo.reset()


def test_compiled_layers_trace_a_flex_attention_built_before_them(monkeypatch):
    """attend() builds its flex_attention at the first call. Built inside the first traced layer, the list it fills
    became a guard (``not G['_FLEX']``) that every later call failed, so the layers compiled again (seen on the
    GPU). compile_layers builds it first: two flex forwards of other sizes run one graph. CPU, dynamo with the
    eager backend (inductor's C++ flex kernels fail to build for symbolic sizes here), no gradient (flex_attention
    has no backward on the CPU). Also: inductor's mixed-order reductions skip their size checks, each a guard."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from dflashkit.drafter import modeling_dflash

    monkeypatch.setattr(modeling_dflash, "_FLEX", [])  # as in a fresh process
    V, H, B = 32, 16, 4
    eager, compiled = eager_and_uncompiled_twin(V, H, B, counters)
    with inductor_config.patch({"triton.mix_order_reduction_non_strict_mode": False}):
        compile_layers(compiled, backend="eager")
        assert inductor_config.triton.mix_order_reduction_non_strict_mode
    head = Head(V, H)
    graphs = []
    for lens in ([100, 90], [150, 120, 60]):
        samples = [{**s, "hidden": s["hidden"].float()} for s in make_samples(lens, V, H, seed=len(lens))]
        batch = collate_blocks(samples, CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=40, seed=0))
        with torch.no_grad():
            passes = PassOptions(block_size=B, layer_types=["full_attention"] * 2, sliding_window=None)
            want = forward_blocks(eager, head, batch, passes).loss_sum
            got = forward_blocks(compiled, head, batch, replace(passes, backend="flex")).loss_sum
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1], graphs  # both layers and both sizes: one graph
    torch._dynamo.reset()
