"""The DFlash2 selector's pairwise term in training, ``<gate, successor_codebook[candidate]>``, without the rows.

``CandidateSelector.pair_scores`` (drafter/modeling_dflash2.py) computes it as the reference does: the codebook
rows of every candidate gathered ([positions, top_k, rank]), then a batched matmul. At the testbed's shape those
rows are ~640 MB a micro-batch in bf16 and their float32 gradient 1.3 GB; in a profiled DFlash2 step the gather,
the batched matmuls, the copies and the codebook's embedding backward took ~10 ms of the 43 ms a DFlash2 step
costs more than a DFlash step (H200). ``pair_term`` is the same term where the Triton
kernels of train/selector_pair_triton.py run (CUDA, or the interpreter in the tests): one pass reads the rows from
the codebook for the scores, one for both gradients, and no [positions, top_k, rank] tensor exists.

It is used when the run asks for it (``selector_kernel: true``; off by default: on one H100 it took 3.6 ms
against torch's 4.8 and a twentieth of the memory, but ~1% of a step), and
only where the kernels fit; elsewhere (the CPU) it is the model's own torch expression. Under autocast the kernels
compute as autocast's matmul would: gate and codebook rows in the autocast dtype, products summed in float32,
the scores in that dtype; the gradients are summed in float32 (the codebook's with atomics: its last bits vary
between runs, train/selector_pair_triton.py).
"""

from __future__ import annotations

import torch

from dflashkit.drafter.modeling_dflash2 import gathered_pair_term as pair_reference  # the model's own expression
from dflashkit.targets.runtime.kernels import triton_available

MAX_RANK = 512  # the largest selector rank the kernels hold in registers (the public DFlash2 recipes use 256)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the kernels sum in float32: float64 stays with torch


def kernel_fits(gate: torch.Tensor, ids: torch.Tensor, codebook: torch.Tensor) -> bool:
    """Whether ``pair_term`` runs the kernels: Triton runs on the device, gate and codebook in float32, bf16 or
    fp16, a rank the kernels hold, at least one position and candidate."""
    return (triton_available(gate.device) and gate.device == codebook.device == ids.device
            and gate.dtype in FLOATS and codebook.dtype in FLOATS and codebook.dim() == 2
            and 1 <= codebook.shape[1] <= MAX_RANK and gate.shape[-1] == codebook.shape[1]
            and ids.shape[:-1] == gate.shape[:-1] and ids.shape[-1] >= 1 and gate.numel() > 0)


class _PairTerm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, ids, codebook, dtype):
        from .selector_pair_triton import launch_forward

        book = codebook.detach().to(dtype).contiguous()  # the rows as autocast's matmul would read them
        gate, ids = gate.contiguous(), ids.contiguous()
        out = torch.empty(ids.shape, dtype=dtype, device=gate.device)
        launch_forward(gate, ids, book, out)
        ctx.save_for_backward(gate, ids, book)
        ctx.book_dtype = codebook.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        from .selector_pair_triton import launch_backward

        gate, ids, book = ctx.saved_tensors
        grad_gate = torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
        grad_book = torch.zeros(book.shape, dtype=torch.float32, device=gate.device)
        launch_backward(grad.contiguous(), gate, ids, book, grad_gate, grad_book)
        return grad_gate.to(gate.dtype), None, grad_book.to(ctx.book_dtype), None


def pair_term(gate: torch.Tensor, ids: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``pair_reference``'s value and gradients (to the gate and the codebook), by the kernels where they fit."""
    if not kernel_fits(gate, ids, codebook):
        return pair_reference(gate, ids, codebook)
    dev = gate.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(
        gate.dtype, codebook.dtype)
    rank, k = gate.shape[-1], ids.shape[-1]
    out = _PairTerm.apply(gate.reshape(-1, rank).to(dtype), ids.reshape(-1, k), codebook, dtype)
    return out.view(*ids.shape)
