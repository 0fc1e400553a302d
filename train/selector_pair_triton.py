"""Triton kernels of the DFlash2 selector's pairwise term (imported only where Triton runs; train/selector_pair.py).

The term is ``out[p, j] = <gate[p], book[ids[p, j]]>`` over the selector's rank r, for P draft positions and their
k candidates. The torch path gathers the codebook rows of every candidate ([P, k, r]: ~640 MB in bf16 for a
testbed micro-batch of ~78k positions, k 16, r 256), multiplies them in a batched matmul, and its backward writes
their gradient ([P, k, r], then upcast to float32) for the codebook's embedding backward. These kernels never
hold the rows: a program takes BLOCK_P positions, keeps their gates in registers and, candidate by candidate,
reads each row straight from the codebook (in the compute dtype; a copy cast once per call, 25 MB at the
testbed's vocabulary, as autocast would), adding the products up in float32.

- ``_pair_forward``: the scores, stored in the compute dtype (the batched matmul's output dtype).
- ``_pair_backward``: the gate's gradient (the rows weighted by the scores' gradient, summed over the
  candidates, float32) and the codebook's: each product ``grad[p, j] * gate[p]`` added with a float32 atomic into
  row ``ids[p, j]`` of a zeroed float32 buffer. Atomics make the codebook gradient's summation order, and so its
  last bits, vary between runs (the torch path's sorted embedding backward does not); the products are not rounded
  to bf16 first, as the torch path's gradient rows are.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pair_forward(Gate, Ids, Book, Out, n_pos, rank, stride_g, stride_i, stride_b, stride_o,
                  K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    r = tl.arange(0, BLOCK_R)
    p_ok = p < n_pos
    ok = p_ok[:, None] & (r < rank)[None, :]
    gate = tl.load(Gate + p[:, None] * stride_g + r[None, :], mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        ids = tl.load(Ids + p * stride_i + j, mask=p_ok, other=0).to(tl.int64)
        rows = tl.load(Book + ids[:, None] * stride_b + r[None, :], mask=ok, other=0.0).to(tl.float32)
        score = tl.sum(gate * rows, axis=1)
        tl.store(Out + p * stride_o + j, score.to(Out.dtype.element_ty), mask=p_ok)


@triton.jit
def _pair_backward(Grad, Gate, Ids, Book, GradGate, GradBook, n_pos, rank, stride_d, stride_g, stride_i,
                   stride_b, stride_gg, stride_gb, K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    r = tl.arange(0, BLOCK_R)
    p_ok = p < n_pos
    ok = p_ok[:, None] & (r < rank)[None, :]
    gate = tl.load(Gate + p[:, None] * stride_g + r[None, :], mask=ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_R], dtype=tl.float32)
    for j in tl.static_range(K):
        grad = tl.load(Grad + p * stride_d + j, mask=p_ok, other=0.0).to(tl.float32)
        ids = tl.load(Ids + p * stride_i + j, mask=p_ok, other=0).to(tl.int64)
        rows = tl.load(Book + ids[:, None] * stride_b + r[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += grad[:, None] * rows
        tl.atomic_add(GradBook + ids[:, None] * stride_gb + r[None, :], grad[:, None] * gate, mask=ok)
    tl.store(GradGate + p[:, None] * stride_gg + r[None, :], acc, mask=ok)


def launch_forward(gate, ids, book, out, block_p: int = 32, num_warps: int = 8) -> None:
    """gate [P, r], ids [P, k] (int), book [V, r] (all contiguous in their last dim; gate and book in the compute
    dtype) -> out [P, k] (that dtype)."""
    n_pos, rank = gate.shape
    grid = (triton.cdiv(n_pos, block_p),)
    _pair_forward[grid](gate, ids, book, out, n_pos, rank, gate.stride(0), ids.stride(0), book.stride(0),
                        out.stride(0), K=ids.shape[1], BLOCK_P=block_p, BLOCK_R=triton.next_power_of_2(rank),
                        num_warps=num_warps)


def launch_backward(grad, gate, ids, book, grad_gate, grad_book, block_p: int = 32, num_warps: int = 8) -> None:
    """grad [P, k] -> grad_gate [P, r] (float32, written) and grad_book [V, r] (float32, zeroed, added into)."""
    n_pos, rank = gate.shape
    grid = (triton.cdiv(n_pos, block_p),)
    _pair_backward[grid](grad, gate, ids, book, grad_gate, grad_book, n_pos, rank, grad.stride(0), gate.stride(0),
                         ids.stride(0), book.stride(0), grad_gate.stride(0), grad_book.stride(0), K=ids.shape[1],
                         BLOCK_P=block_p, BLOCK_R=triton.next_power_of_2(rank), num_warps=num_warps)
