"""train/selector_pair.py: DFlash2's pairwise selector term by Triton kernels (no [positions, top_k, rank] rows)
gives the model's torch expression's values and gradients: the kernels in the Triton interpreter on the CPU
(float32, and bf16 under autocast as the trainer runs it), the trainer's pass with ``selector_kernel`` on, and
on a CUDA device at the testbed's shape."""

import textwrap

import pytest
import torch

from dflashkit.train import selector_pair
from dflashkit.train.selector_pair import kernel_fits, pair_reference, pair_term

from support.triton_interpreter import INTERPRETER_PREAMBLE, count_launches, run_in_interpreter


def test_the_cpu_path_is_the_models_expression():
    """Without the interpreter the CPU never takes the kernels: pair_term is the einsum on the gathered rows, the
    same tensor bit for bit, and so are the gradients."""
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(5, 3, 8, generator=g, requires_grad=True)
    book = torch.randn(11, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (5, 3, 4), generator=g)
    assert not kernel_fits(gate, ids, book)
    out = pair_term(gate, ids, book)
    ref = torch.einsum("...r,...kr->...k", gate, book[ids])
    assert out.shape == (5, 3, 4) and torch.equal(out, ref)
    grads = torch.autograd.grad(out.sum(), (gate, book))
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(ref.sum(), (gate, book))))


def test_the_kernels_fit_only_their_cases(monkeypatch):
    """Where Triton runs (the interpreter's flag stands in for a device): float32/bf16/fp16, ranks up to MAX_RANK,
    matching shapes; float64, a wider rank or mismatched ids stay with torch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="triton is not installed")
    gate, book, ids = torch.zeros(4, 6, 16), torch.zeros(9, 16), torch.zeros(4, 6, 3, dtype=torch.long)
    assert kernel_fits(gate, ids, book) and kernel_fits(gate.bfloat16(), ids, book)
    assert not kernel_fits(gate.double(), ids, book.double())
    wide = selector_pair.MAX_RANK + 1
    assert not kernel_fits(torch.zeros(4, wide), torch.zeros(4, 3, dtype=torch.long), torch.zeros(9, wide))
    assert not kernel_fits(gate, ids[:3], book) and not kernel_fits(gate, ids, torch.zeros(9, 8))


COUNT_LAUNCHES = count_launches("dflashkit.train.selector_pair_triton")

KERNEL_SCRIPT = INTERPRETER_PREAMBLE + COUNT_LAUNCHES + textwrap.dedent("""
    from dflashkit.train.selector_pair import pair_reference, pair_term
    g = torch.Generator().manual_seed(1)
    results = {}
    def compare(name, gate, ids, book, autocast):
        # [forward launches, backward launches, max |value diff|, max |gate grad diff|, max |book grad diff|,
        #  max |value|, max |book grad|]
        before = dict(launches)
        outs = []
        for fn in (pair_term, pair_reference):
            a, b = gate.detach().clone().requires_grad_(), book.detach().clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = fn(a, ids, b)
            weight = torch.linspace(-1, 1, out.numel()).view(out.shape)  # a gradient that differs per score
            (out.float() * weight).sum().backward()
            outs.append((out.float(), a.grad, b.grad, out.dtype))
        (o, ga, gb, dt), (ro, rga, rgb, rdt) = outs
        results[name] = [launches["forward"] - before["forward"], launches["backward"] - before["backward"],
                         (o - ro).abs().max().item(), (ga - rga).abs().max().item(), (gb - rgb).abs().max().item(),
                         ro.abs().max().item(), rgb.abs().max().item(), str(dt) == str(rdt)]
    # 37 positions (a partial program of 32), 5 candidates, rank 24 (padded to 32), 11 tokens: many ids repeat
    # inside one program, so the codebook gradient's atomics collide
    gate, book = torch.randn(37, 24, generator=g), torch.randn(11, 24, generator=g)
    compare("fp32", gate, torch.randint(0, 11, (37, 5), generator=g), book, False)
    # the trainer's shapes: [N, B-1, r] gates, [N, B-1, k] ids, an fp32 codebook, bf16 autocast
    gate, book = torch.randn(6, 7, 64, generator=g), torch.randn(50, 64, generator=g)
    compare("bf16 autocast", gate, torch.randint(0, 50, (6, 7, 16), generator=g), book, True)
    print(json.dumps(results))
""")


def test_the_kernels_give_the_reference_values_and_gradients_in_interpreter():
    """One forward and one backward launch each; float32: values and both gradients within float32 rounding of
    the einsum's (repeated ids added up right); bf16 under autocast: the same dtype out, values within bf16
    rounding, gradients within it too (the kernels sum in float32, the einsum rounds its products' rows)."""
    results = run_in_interpreter(KERNEL_SCRIPT)
    fp32, bf16 = results["fp32"], results["bf16 autocast"]
    assert fp32[:2] == [1, 1] and fp32[7], fp32
    assert fp32[2] < 1e-5 * fp32[5] and fp32[3] < 1e-4 and fp32[4] < 1e-5 * fp32[6], fp32
    assert bf16[:2] == [1, 1] and bf16[7], bf16
    assert bf16[2] < 2e-2 * bf16[5] and bf16[3] < 5e-2 and bf16[4] < 2e-2 * bf16[6], bf16


PASS_SCRIPT = INTERPRETER_PREAMBLE + COUNT_LAUNCHES + textwrap.dedent("""
    import dataclasses
    from dflashkit.drafter.kinds.dflash2 import SelectorOptions
    from dflashkit.train.data import CollateOptions, collate_blocks
    from dflashkit.train.drafter_pass import PassOptions, forward_blocks
    from dflashkit.train.loss import LossSettings
    from support.packed_blocks import Head, make_samples, tiny_drafter
    V, H, B = 40, 32, 4
    torch.manual_seed(0)
    model = tiny_drafter(V, H, B, architecture="dflash2", selector_rank=8, selector_top_k=8, conv_group_size=8)
    model = model.float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a successor codebook off zero: its term moves the loss
    head = Head(V, H, scale=1.5).float()
    batch = collate_blocks(make_samples([14, 9, 21], V, H, seed=1),
                           CollateOptions(block_size=B, mask_token_id=V - 1, num_anchors=6, seed=3, epoch=2))
    batch = dataclasses.replace(batch, target_hidden=batch.target_hidden.float())
    runs = []
    for kernel in (True, False):
        model.zero_grad(set_to_none=True)
        out = forward_blocks(model, head, batch, PassOptions(
            block_size=B, layer_types=["full_attention"] * 2, sliding_window=None, loss=LossSettings(chunk_tokens=7),
            term_options=SelectorOptions(kernel=kernel)))
        (out.loss_sum + out.selector.loss_sum).backward()
        runs.append((out.selector.loss_sum.item(), out.loss_sum.item(),
                     {n: p.grad.clone() for n, p in model.named_parameters()}))
    (sel, blk, grads), (rsel, rblk, rgrads) = runs
    diff = max(((grads[n] - rgrads[n]).abs().max() / rgrads[n].abs().max().clamp_min(1e-12)).item()
               for n in rgrads)
    print(json.dumps([launches, sel, rsel, blk, rblk, diff, sorted(n for n in rgrads if "candidate_selector" in n)]))
""")


def test_the_training_pass_with_the_kernel_in_interpreter():
    """forward_blocks with SelectorOptions(kernel=True) on a tiny DFlash2 drafter: the kernels run (once forward, once
    backward), and the selector term, the block loss and every parameter's gradient are those without them."""
    launches, sel, rsel, blk, rblk, diff, selector_params = run_in_interpreter(PASS_SCRIPT)
    assert launches == {"forward": 1, "backward": 1}, launches
    assert sel == pytest.approx(rsel, rel=1e-5) and blk == rblk
    assert diff < 1e-4, diff
    assert "candidate_selector.successor_codebook" in selector_params


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernels_on_cuda_at_the_testbed_shape():
    """DFlash2's k 16 and rank 256 over the testbed's vocabulary, 8,192 positions (a tenth of a training
    micro-batch's), bf16 autocast: the kernels run and match the einsum within bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(2)
    gate = torch.randn(512, 16, 256, device="cuda", generator=g)
    book = (0.1 * torch.randn(49152, 256, device="cuda", generator=g))
    ids = torch.randint(0, 49152, (512, 16, 16), device="cuda", generator=g)
    assert kernel_fits(gate, ids, book)
    results = []
    for fn in (pair_term, pair_reference):
        a, b = gate.clone().requires_grad_(), book.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(a, ids, b)
        out.float().sum().backward()
        results.append((out.float(), a.grad, b.grad))
    (o, ga, gb), (ro, rga, rgb) = results
    assert (o - ro).abs().max() <= 2e-2 * ro.abs().max()
    assert (ga - rga).abs().max() <= 2e-2 * rga.abs().max() and (gb - rgb).abs().max() <= 2e-2 * rgb.abs().max()
