"""The selector candidates' top-k of each row of a chunk's logits, found among the row's best groups (a
DFlash2 drafter's candidate selector, train/selector_loss.py; the loss engine, train/loss.py, calls it on each
chunk's logits).

Design choices:
- A radix select over a whole vocabulary row is the slowest op of a DFlash2 step
  on a GPU (``torch.topk`` of [2048, 49152] bf16 logits, k 16: 1.04 ms a chunk in a profiled step, against 0.16 ms
  for the statistics kernel that reads the same logits; 21% of the step's GPU time; alone 0.81 ms against 0.40 ms
  for grouped_topk, H200). The row is cut into groups of
  ``TOPK_GROUP`` logits; the k groups with the largest maxima hold every one of the row's k largest values (a
  group outside them has k groups whose maxima are at least its own, so any value of it has k larger or equal
  ones elsewhere), so the top_k runs on those k groups (plus the tail when the vocabulary is not a multiple of
  the group) instead of the row: the same values, ids differing from ``torch.topk``'s only among equal logits.
  The group maxima come from the loss engine's own read of the logits (train/loss.py ``_logit_stats_grouped``: per
  group its max, first argmax and sum of exp, the row's logsumexp and argmax from those), not from a second
  read (GPU time of 3 profiled DFlash2 steps 797 -> 756 ms, H200).
- Where Triton runs (``triton_available``) and the vocabulary is whole groups, grouped_topk is one Triton kernel
  launch per chunk (train/grouped_topk_triton.py) instead of its torch ops (two topk, the gather of the chosen
  groups and the index arithmetic: ~50 of 738 ms GPU time in a profile of 3 DFlash2 steps, H200; the kernel takes
  0.059 ms a chunk of 2,048 rows x 49,152 against the torch path's 0.336 ms, but does not
  show in whole-step medians yet): one program per row takes the k largest one by one, each from the group
  whose best logit not yet taken is the largest, starting from the given maxima, so it reads only those groups.
  The values are torch.topk's; on equal logits it takes the lowest column, so its ids may differ from those of
  the torch path (``grouped_topk_reference``, the CPU path) only among equal logits.
"""

from __future__ import annotations

import torch

from dflashkit.targets.runtime.kernels import triton_available

TOPK_GROUP = 256  # logits per group of grouped_topk (the fastest of 64-512 on an H200)


def groups_pay(cols: int, k: int, group: int = TOPK_GROUP) -> bool:
    """Whether grouped_topk cuts a row of ``cols`` into groups (else it is torch.topk over the row)."""
    return cols // group >= 4 * k


def topk_kernel_runs(x: torch.Tensor, k: int, group: int = TOPK_GROUP) -> bool:
    """Whether grouped_topk runs the Triton kernel on ``x``: Triton runs on its device, groups pay, and the case
    is the kernel's (train/grouped_topk_triton.py ``kernel_fits``: fp32/bf16/fp16 logits with unit column stride,
    whole power-of-two groups)."""
    if not (x.dim() == 2 and groups_pay(x.shape[1], k, group) and triton_available(x.device)):
        return False
    from .grouped_topk_triton import kernel_fits

    return kernel_fits(x, k, group)


def grouped_topk(x: torch.Tensor, k: int, group: int = TOPK_GROUP, group_max: torch.Tensor | None = None,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of 2-D ``x``, largest first: the values of
    ``torch.topk(x, k)``, found among the k groups of ``group`` columns with the largest maxima (module notes).
    ``group_max``: those maxima [rows, cols // group] when already computed (the loss engine's statistics; any dtype
    that keeps their order, exact for the kernel's tie rule). Rows too short for groups to save work go to
    ``torch.topk`` whole. ``out``: contiguous (values in x's dtype, long indices) [rows, k] to write them into
    (no copy after), returned. The Triton kernel where ``topk_kernel_runs``, else ``grouped_topk_reference``."""
    if topk_kernel_runs(x, k, group):
        from .grouped_topk_triton import grouped_topk_triton

        return grouped_topk_triton(x, k, group, group_max, out)
    return grouped_topk_reference(x, k, group, group_max, out)


def grouped_topk_reference(x: torch.Tensor, k: int, group: int = TOPK_GROUP, group_max: torch.Tensor | None = None,
                           out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_topk in torch ops, any vocabulary (a tail past the last whole group too): the CPU path, and the
    GPU's where the kernel does not run. Arguments and result as grouped_topk's; on equal logits the ids are
    whichever torch.topk of the candidates returns."""
    rows, cols = x.shape
    n_groups = cols // group
    if not groups_pay(cols, k, group):
        return torch.topk(x, k, dim=-1, out=out) if out is not None else torch.topk(x, k, dim=-1)
    body = n_groups * group
    grouped = x[:, :body].view(rows, n_groups, group)
    if group_max is None:
        group_max = grouped.amax(-1)
    best = torch.topk(group_max, k, dim=-1).indices  # [rows, k]: the groups holding the top k
    # the chosen groups' logits, the index broadcast along each group (no [rows, k * group] index is written)
    cand = grouped.gather(1, best.unsqueeze(-1).expand(rows, k, group)).view(rows, k * group)
    if body < cols:  # the tail columns are always candidates
        cand = torch.cat([cand, x[:, body:]], dim=-1)
    if out is None:
        values, at = torch.topk(cand, k, dim=-1)
        ids = torch.empty_like(at)
    else:
        (values, ids), at = out, torch.empty_like(out[1])
        torch.topk(cand, k, dim=-1, out=(values, at))
    if body == cols:  # every candidate lies in a chosen group
        return values, torch.add(best.gather(1, at // group) * group, at % group, out=ids)
    in_body = at < k * group
    in_group = best.gather(1, (at // group).clamp(max=k - 1)) * group + at % group
    return values, torch.where(in_body, in_group, at - k * group + body, out=ids)
