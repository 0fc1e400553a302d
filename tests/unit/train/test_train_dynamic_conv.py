"""train/dynamic_conv.py: DFlash2's in-block convolution by Triton kernels gives the model's torch expression's
values and gradients: the kernels in the Triton interpreter on the CPU (float32 exactly, bf16 within its
rounding), inside a drafter layer compiled for dynamic shapes as the trainer compiles it, the trainer's switch
(``conv_kernel``), and on a CUDA device at the testbed's shape."""

import textwrap

import pytest
import torch

from dflashkit.drafter.modeling_dflash2 import grouped_dynamic_causal_conv
from dflashkit.train import dynamic_conv
from dflashkit.train.config import TrainConfig
from dflashkit.train.dynamic_conv import dynamic_conv as conv_kernel_path
from dflashkit.train.dynamic_conv import kernel_fits
from dflashkit.train.setup_drafter import conv_kernels

from support.packed_blocks import tiny_drafter
from support.triton_interpreter import INTERPRETER_PREAMBLE, count_launches, run_in_interpreter


def test_the_kernels_fit_only_their_cases():
    """Float32/bf16/fp16, whole blocks, a power-of-two group up to MAX_GROUP, up to MAX_TAPS taps; float64, a
    group of 12, a run of positions that is not whole blocks, too many taps stay with the torch expression."""
    x, dyn, base = torch.zeros(2, 32, 48), torch.zeros(2, 32, 3, 3), torch.zeros(3, 48)
    assert kernel_fits(x, dyn, base, 16, 16) and kernel_fits(x.bfloat16(), dyn.bfloat16(), base, 16, 8)
    assert not kernel_fits(x.double(), dyn.double(), base.double(), 16, 16)
    assert not kernel_fits(x, torch.zeros(2, 32, 3, 4), base, 12, 16)  # 48 / 12 groups: not a power of two
    assert not kernel_fits(x[:, :24], dyn[:, :24], base, 16, 16)  # 24 positions: not whole blocks of 16
    taps = dynamic_conv.MAX_TAPS + 1
    assert not kernel_fits(x, torch.zeros(2, 32, taps, 3), torch.zeros(taps, 48), 16, 16)
    assert not kernel_fits(x, dyn[..., :2], base, 16, 16)  # dynamic taps for another group size
    assert not kernel_fits(x, dyn[:, :16], base, 16, 16)  # taps for other positions than the rows


def test_the_switch_leaves_a_cpu_run_and_dflash_alone(monkeypatch):
    """Without the interpreter the CPU keeps the model's expression (0 convolutions pointed, said so); with
    ``conv_kernel`` off, or a DFlash drafter, nothing is pointed either. Where Triton runs (the interpreter's flag
    stands in for a device) every convolution of the DFlash2 drafter is: 2 layers x 2."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_drafter(16, 32, 4, architecture="dflash2", selector_rank=4, selector_top_k=4, conv_group_size=8,
                         conv_kernel_size=2)
    convs = [m for m in model.modules() if isinstance(m, dynamic_conv.GroupedDynamicCausalConv)]
    said = []
    on = TrainConfig(drafter_architecture="dflash2", conv_kernel=True)
    assert conv_kernels(on, model, torch.device("cpu"), said.append) == 0
    assert "Triton does not run on cpu" in said[0]
    assert all(c.conv_fn is grouped_dynamic_causal_conv for c in convs) and len(convs) == 4
    assert conv_kernels(TrainConfig(drafter_architecture="dflash2"), model, torch.device("cpu"), said.append) == 0
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plain = tiny_drafter(16, 32, 4)
    assert conv_kernels(TrainConfig(conv_kernel=True), plain, torch.device("cpu"), said.append) == 0
    assert conv_kernels(on, model, torch.device("cpu"), said.append) == 4 and "4 in-block" in said[-1]
    assert all(c.conv_fn is conv_kernel_path for c in convs)


def test_the_cpu_path_is_the_models_expression():
    """Where the kernels do not fit, dynamic_conv is the model's expression: the same tensor bit for bit."""
    g = torch.Generator().manual_seed(0)
    x, dyn, base = (torch.randn(2, 24, 16, generator=g, dtype=torch.float64), torch.randn(2, 24, 2, 2,
                    generator=g, dtype=torch.float64), torch.randn(2, 16, generator=g, dtype=torch.float64))
    assert not kernel_fits(x, dyn, base, 8, 8)
    assert torch.equal(conv_kernel_path(x, dyn, base, 8, 8), grouped_dynamic_causal_conv(x, dyn, base, 8, 8))


COUNT_LAUNCHES = count_launches("dflashkit.train.dynamic_conv_triton")

KERNEL_SCRIPT = INTERPRETER_PREAMBLE + COUNT_LAUNCHES + textwrap.dedent("""
    from dflashkit.drafter.modeling_dflash2 import grouped_dynamic_causal_conv as reference
    from dflashkit.train.dynamic_conv import dynamic_conv
    results = {}
    def run(fn, x, proj, base, group, block, dtype=None):
        # the second of the two tap sets, as GroupedDynamicCausalConv.finish reads it (a strided view)
        a, p, b = (t.detach().clone() for t in (x, proj, base))
        if dtype is not None:
            a, p, b = a.to(dtype), p.to(dtype), b.to(torch.bfloat16).to(dtype)  # the taps as the kernels round them
        for t in (a, p, b):
            t.requires_grad_()
        out = fn(a, p[..., 1, :, :], b, group, block)
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)  # a gradient per value
        (out * weight).sum().backward()
        return [t.double() for t in (out, a.grad, p.grad, b.grad)], out.dtype
    def compare(name, x, proj, base, group, block, exact):
        before = dict(launches)
        got, dtype = run(dynamic_conv, x, proj, base, group, block)
        want, _ = run(reference, x, proj, base, group, block, None if exact else torch.float64)
        errors = [((u - w).abs().max() / w.abs().max()).item() for u, w in zip(got, want)]
        results[name] = [launches["forward"] - before["forward"], launches["backward"] - before["backward"],
                         errors, str(dtype) == str(x.dtype)]
    g = torch.Generator().manual_seed(1)
    # (taps, group, block, blocks, width): the testbed's 2 taps over groups of 16; 3 taps of groups of 8 on
    # blocks of 4 (5 row tiles: 70 blocks of 4 = 280 rows, the last tile partial); more taps than the block
    # has positions; a width of 40 (a partial tile of channels)
    for taps, group, block, blocks, width in ((2, 16, 16, 5, 96), (3, 8, 4, 70, 40), (5, 16, 4, 3, 48)):
        x = torch.randn(2, blocks * block, width, generator=g)
        proj = 0.5 * torch.randn(2, blocks * block, 2, taps, width // group, generator=g)
        base = torch.randn(taps, width, generator=g)
        compare(f"fp32 {taps} {group} {block}", x, proj, base, group, block, True)
    x = torch.randn(1, 128, 64, generator=g).bfloat16()
    proj = (0.3 * torch.randn(1, 128, 2, 2, 4, generator=g)).bfloat16()
    compare("bf16", x, proj, torch.randn(2, 64, generator=g), 16, 16, False)
    print(json.dumps(results))
""")


def test_the_kernels_give_the_reference_values_and_gradients_in_interpreter():
    """One forward and one backward launch per call; float32: the value and the three gradients (x, the
    dynamic taps through their strided view, the base taps) within float32 rounding of the torch expression's,
    at the testbed's taps, at 3 taps over 70 blocks of 4 (row tiles that hold several blocks, a partial last
    tile), with more taps than positions, and a partial tile of channels; bf16 (the kernels' output dtype is
    x's): within bf16 rounding of the float64 expression on the same rounded inputs (the interpreter truncates
    where a GPU rounds, hence 2^-6 rather than 2^-8)."""
    results = run_in_interpreter(KERNEL_SCRIPT)
    for name, (forward, backward, errors, same_dtype) in results.items():
        assert (forward, backward, same_dtype) == (1, 1, True), (name, results[name])
        bound = 2 ** -6 if name == "bf16" else 1e-5
        assert max(errors) < bound, (name, errors)


PASS_SCRIPT = INTERPRETER_PREAMBLE + COUNT_LAUNCHES + textwrap.dedent("""
    import dataclasses
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.data import CollateOptions, collate_blocks
    from dflashkit.train.drafter_pass import PassOptions, compile_layers, forward_blocks
    from dflashkit.train.loss import LossSettings
    from dflashkit.train.setup_drafter import conv_kernels
    from support.packed_blocks import Head, make_samples, tiny_drafter
    V, H, B = 40, 32, 4
    torch.manual_seed(0)
    def drafter():
        torch.manual_seed(0)
        m = tiny_drafter(V, H, B, architecture="dflash2", selector_rank=8, selector_top_k=8, conv_group_size=8,
                         conv_kernel_size=3).float()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn_like(p))  # convolutions off the identity: their taps move the loss
        return m
    head = Head(V, H, scale=1.5).float()
    blocks = CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2)
    batches = [collate_blocks(make_samples(lens, V, H, seed=1), blocks) for lens in ([14, 9, 21], [17, 12])]
    batches = [dataclasses.replace(b, target_hidden=b.target_hidden.float()) for b in batches]
    runs = []
    for kernel in (True, False):
        model = drafter()
        if kernel:  # the trainer's order: the switch, then the layers compiled for dynamic shapes
            assert conv_kernels(TrainConfig(drafter_architecture="dflash2", conv_kernel=True), model, "cpu") == 4
            compile_layers(model)
        losses, grads = [], []
        for batch in batches:  # two shapes through the same compiled layers
            model.zero_grad(set_to_none=True)
            out = forward_blocks(model, head, batch, PassOptions(
                block_size=B, layer_types=["full_attention"] * 2, sliding_window=None,
                loss=LossSettings(chunk_tokens=7)))
            (out.loss_sum + out.selector.loss_sum).backward()
            losses.append(out.loss_sum.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        runs.append((losses, grads))
    (losses, grads), (rlosses, rgrads) = runs
    diff = max(((a[n] - r[n]).abs().max() / r[n].abs().max().clamp_min(1e-12)).item()
               for a, r in zip(grads, rgrads) for n in r)
    conv_grads = sorted(n for n in rgrads[0] if "_conv." in n)
    print(json.dumps([launches, losses, rlosses, diff, len(conv_grads), sorted(rgrads[0]) == sorted(grads[0])]))
""")


def test_the_compiled_training_pass_with_the_kernels_in_interpreter():
    """forward_blocks on a tiny DFlash2 drafter (3 taps, convolutions off the identity) with ``conv_kernel`` and
    its layers compiled for dynamic shapes, as the trainer runs them, over two batches of different shapes: the
    kernels run for every convolution (2 layers x 4, forward and backward, each batch), and the block loss and
    every parameter's gradient (the 8 convolution parameters of each layer's two convolutions among them) are
    those of the eager drafter without the kernels."""
    launches, losses, rlosses, diff, conv_grads, same_params = run_in_interpreter(PASS_SCRIPT)
    assert launches == {"forward": 16, "backward": 16}, launches
    assert losses == pytest.approx(rlosses, rel=1e-5) and same_params
    assert conv_grads == 8 and diff < 1e-4, (conv_grads, diff)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernels_on_cuda_at_the_testbed_shape():
    """The testbed's DFlash2 convolution (2 taps over groups of 16, width 576, blocks of 16) over 512 blocks in
    bf16: the kernels run and are at least as close to the float64 expression as the bf16 torch expression."""
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 512 * 16, 576, device="cuda", generator=g).bfloat16()
    dyn = (0.3 * torch.randn(1, 512 * 16, 2, 36, device="cuda", generator=g)).bfloat16()
    base = torch.randn(2, 576, device="cuda", generator=g)
    assert kernel_fits(x, dyn, base, 16, 16)
    results = []
    for fn, dtype in ((grouped_dynamic_causal_conv, torch.float64), (grouped_dynamic_causal_conv, None),
                      (conv_kernel_path, None)):
        a, d, b = x.clone(), dyn.clone(), base.clone()
        if dtype is not None:
            a, d, b = a.to(dtype), d.to(dtype), b.bfloat16().to(dtype)
        for t in (a, d, b):
            t.requires_grad_()
        out = fn(a, d, b, 16, 16)
        (out * torch.linspace(-1, 1, out.numel(), device="cuda", dtype=out.dtype).view(out.shape)).sum().backward()
        results.append([t.double() for t in (out, a.grad, d.grad, b.grad)])
    exact, eager, kernel = results
    for e, k, w in zip(eager, kernel, exact):
        scale = w.abs().max()
        assert (k - w).abs().max() <= max(1.5 * (e - w).abs().max(), 2 ** -8 * scale), ((k - w).abs().max(), scale)
