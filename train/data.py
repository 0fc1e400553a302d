"""Training data: the held-out split, which sample each rank trains on at each step, and packing one
sequence's blocks into one drafter pass.

Design choices:
- One micro-batch = one sequence (context features ``[1, L, K*H]``) and its N blocks, all in one forward.
- The order is global and deterministic: epoch e trains ``epoch_order(train, seed, e)``; step s of the epoch
  covers the slots ``s*W*G .. (s+1)*W*G - 1`` (W ranks, G accumulation steps); rank r takes slots
  ``s*W*G + j*W + r`` for j < G. A single process with G' = W*G therefore sees exactly the samples of a W-rank
  run, and the position in the data is one number (samples of the epoch already consumed).
- The last step of an epoch may have fewer samples than slots: the empty slots repeat a sample with weight 0
  (every rank still runs G forward/backward passes, which DDP and DeepSpeed need), so an epoch trains each
  sample exactly once and is never cut short.
- Anchors depend on (seed, epoch, sample index) only: a resumed or re-sharded run draws the same ones.
- Sequences longer than ``max_length`` are truncated to their first ``max_length`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .anchors import eval_anchors, sample_anchors, sample_generator


@dataclass
class PackedBlocks:
    target_hidden: torch.Tensor  # [1, L, K*H] context features (as stored: bf16)
    block_ids: torch.Tensor  # [1, N*B] per block: anchor token, then mask_token_id x (B-1)
    position_ids: torch.Tensor  # [1, L + N*B] context 0..L-1, then a..a+B-1 per block
    anchors: torch.Tensor  # [N] anchor positions, ascending
    labels: torch.Tensor  # [N, B-1] token at a+k (0 where invalid)
    valid: torch.Tensor  # [N, B-1] a+k < L and loss_mask[a+k]
    teacher_index: torch.Tensor  # [N, B-1] row of last_hidden that predicts label k (a+k-1, clamped)
    last_hidden: torch.Tensor | None  # [L, H] target final hidden states (kl variant), else None
    scale: float  # 1.0; 0.0 for a padding micro-batch that only keeps ranks in step
    sample_index: int  # index of the sample in the shard dataset

    @property
    def ctx_len(self) -> int:
        return self.target_hidden.shape[1]

    def to(self, device, non_blocking: bool = False) -> "PackedBlocks":
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
        return PackedBlocks(**moved)

    def pin_memory(self) -> "PackedBlocks":  # called by DataLoader(pin_memory=True)
        return PackedBlocks(**{f.name: (getattr(self, f.name).pin_memory()
                                        if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name))
                               for f in fields(self)})


def pack_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                block_size: int, mask_token_id: int, last_hidden: torch.Tensor | None = None,
                scale: float = 1.0, sample_index: int = -1) -> PackedBlocks:
    """Lay out the blocks of one sequence. A sequence without any anchor gets one all-invalid block at 0."""
    input_ids = input_ids.reshape(-1).long()
    loss_mask = loss_mask.reshape(-1).bool()
    L, B = input_ids.numel(), int(block_size)
    anchors = anchors.reshape(-1).long()
    if anchors.numel() == 0:
        anchors = torch.zeros(1, dtype=torch.long)
    if (anchors < 0).any() or (anchors >= L).any():
        raise ValueError(f"anchors {anchors.tolist()} outside the sequence of {L} tokens")
    n = anchors.numel()
    k = torch.arange(B)
    pos = anchors[:, None] + k[None, :]  # [N, B] absolute positions of the block tokens
    block_ids = torch.full((n, B), int(mask_token_id), dtype=torch.long)
    block_ids[:, 0] = input_ids[anchors]
    label_pos = pos[:, 1:]
    inside = label_pos < L
    safe = label_pos.clamp(max=L - 1)
    labels = torch.where(inside, input_ids[safe], torch.zeros_like(safe))
    valid = inside & loss_mask[safe]
    position_ids = torch.cat([torch.arange(L), pos.reshape(-1)])[None]
    return PackedBlocks(target_hidden=hidden.reshape(1, L, -1), block_ids=block_ids.reshape(1, -1),
                        position_ids=position_ids, anchors=anchors, labels=labels, valid=valid,
                        teacher_index=(label_pos - 1).clamp(max=L - 1), last_hidden=last_hidden,
                        scale=float(scale), sample_index=int(sample_index))


# --------------------------------------------------------------------------- split and order
def split_indices(num_samples: int, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices; the held-out set is fixed by the seed."""
    if eval_samples >= num_samples:
        raise ValueError(f"eval_samples={eval_samples} leaves no training data ({num_samples} samples); "
                         f"lower eval_samples")
    perm = torch.randperm(num_samples, generator=sample_generator(seed, 0xE7A1)).tolist()
    return sorted(perm[eval_samples:]), sorted(perm[:eval_samples])


def epoch_order(train: list[int], seed: int, epoch: int) -> list[int]:
    perm = torch.randperm(len(train), generator=sample_generator(seed, 0x0DE5, epoch)).tolist()
    return [train[i] for i in perm]


def steps_per_epoch(num_train: int, world_size: int, grad_accum: int) -> int:
    return math.ceil(num_train / (world_size * grad_accum))


def rank_slots(order: list[int], start_sample: int, world_size: int, grad_accum: int,
               rank: int) -> list[tuple[int, bool]]:
    """(sample index, is_padding) for every micro-batch of this rank from ``start_sample`` to the epoch end."""
    per_step = world_size * grad_accum
    if start_sample % per_step:
        raise ValueError(f"resume position {start_sample} is not a multiple of world_size*grad_accum={per_step}; "
                         f"resume with the world size and grad_accum of the checkpointed run")
    out = []
    for base in range(start_sample, len(order), per_step):
        for j in range(grad_accum):
            slot = base + j * world_size + rank
            out.append((order[slot], False) if slot < len(order) else (order[slot % len(order)], True))
    return out


# --------------------------------------------------------------------------- samples -> packed blocks
class BlockSource(torch.utils.data.Dataset):
    """Map-style view over a list of slots: item i = the packed blocks of slot i (DataLoader-friendly)."""

    def __init__(self, dataset, slots: list[tuple[int, bool]], *, block_size: int, mask_token_id: int,
                 num_anchors: int, seed: int, epoch: int, max_length: int | None, use_last_hidden: bool,
                 fixed_anchors: bool = False):
        self.dataset, self.slots = dataset, slots
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.num_anchors, self.seed, self.epoch = num_anchors, seed, epoch
        self.max_length, self.use_last_hidden, self.fixed_anchors = max_length, use_last_hidden, fixed_anchors

    def __len__(self):
        return len(self.slots)

    def __getitem__(self, i: int) -> PackedBlocks:
        index, padding = self.slots[i]
        s = self.dataset[index]
        ids, mask, hidden = s["input_ids"], s["loss_mask"], s["hidden"]
        last = s.get("last_hidden") if self.use_last_hidden else None
        if self.use_last_hidden and last is None:
            raise ValueError(f"sample {index} has no last_hidden: the kl loss needs shards extracted with "
                             f"last_hidden; re-extract, or use loss=dpace (the default) or ce")
        if self.max_length and ids.numel() > self.max_length:
            ids, mask, hidden = ids[: self.max_length], mask[: self.max_length], hidden[: self.max_length]
            last = None if last is None else last[: self.max_length]
        if not torch.isfinite(hidden).all() or (last is not None and not torch.isfinite(last).all()):
            raise ValueError(f"sample {index}: NaN or Inf in the stored features (field "
                             f"{'hidden' if not torch.isfinite(hidden).all() else 'last_hidden'}); "
                             f"re-extract that shard (dflashkit verify names it)")
        if self.fixed_anchors:
            anchors = eval_anchors(mask, self.block_size, self.num_anchors, self.seed, index)
        else:
            anchors = sample_anchors(mask, self.num_anchors, sample_generator(self.seed, self.epoch, index))
        return pack_blocks(ids, mask, hidden, anchors, self.block_size, self.mask_token_id, last_hidden=last,
                           scale=0.0 if padding else 1.0, sample_index=index)


def _identity(x):
    return x


def block_loader(source: BlockSource, num_workers: int = 0, pin_memory: bool = False):
    """An iterator over the packed blocks of ``source`` in order (workers prefetch)."""
    return iter(torch.utils.data.DataLoader(source, batch_size=None, shuffle=False, num_workers=num_workers,
                                            pin_memory=pin_memory, collate_fn=_identity,
                                            persistent_workers=False))
