"""Training data: the held-out split, which micro-batches each rank trains on at each step, and packing several
sequences' blocks into one drafter pass.

Design choices:
- One micro-batch = one or more whole sequences packed end to end (context features ``[1, L, K*H]``) and all
  their blocks, in one forward. ``pack_order`` groups consecutive samples of the epoch order greedily while
  their tokens fit in ``micro_batch_tokens`` (a sample longer than the budget gets a micro-batch of its own;
  0 keeps one sequence per micro-batch). The block mask (train/block_mask.py) keeps every block inside its own
  sequence, and each sequence keeps its own positions (0..L_s-1), so a packed pass computes exactly what the
  per-sequence passes compute.
- ``collate_blocks`` is a plain function of a list of per-sample dicts (``input_ids``, ``loss_mask``,
  ``hidden`` ``[T, K*H]``, optional ``last_hidden``, and ``index``, the sample's position in the dataset, which
  keys its anchors). Shard reading (``BlockSource``) and a target running in the loop both feed it.
- The context and the block tokens are padded to multiples of 128 (flex_attention's tile): tiles then align
  with sequence and block boundaries, and the drafter sees fewer distinct shapes. Padding context rows are zero
  features that no block can see; padding blocks see only themselves and carry no valid label.
- The order is global and deterministic: epoch e trains ``pack_order(epoch_order(train, seed, e), ...)``; step
  s of the epoch covers micro-batches ``s*W*G .. (s+1)*W*G - 1`` (W ranks, G accumulation steps); rank r takes
  ``s*W*G + j*W + r`` for j < G. A single process with G' = W*G therefore sees exactly the samples of a W-rank
  run, and the position in the data is one number (micro-batches of the epoch already consumed; samples when
  each micro-batch holds one sequence).
- The last step of an epoch may have fewer micro-batches than slots: the empty slots repeat one with weight 0
  (every rank still runs G forward/backward passes, which DDP and DeepSpeed need), so an epoch trains each
  sample exactly once and is never cut short.
- Anchors depend on (seed, epoch, sample index) only: a resumed, re-sharded or differently packed run draws
  the same ones.
- Sequences longer than ``max_length`` are truncated to their first ``max_length`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from dflashkit.drafter.modeling_dflash import FLEX_TILE
from dflashkit.errors import UserError

from .anchors import anchor_count, eval_anchors, sample_anchors, sample_generator

PAD_MULTIPLE = FLEX_TILE  # context and block tokens are padded to multiples of flex_attention's tile


@dataclass
class PackedBlocks:
    target_hidden: torch.Tensor  # [1, L, K*H] context features of all sequences, end to end, zero-padded
    block_ids: torch.Tensor  # [1, N*B] per block: anchor token, then mask_token_id x (B-1)
    position_ids: torch.Tensor  # [1, L + N*B] per sequence 0..L_s-1 (padding 0), then a..a+B-1 per block
    anchors: torch.Tensor  # [N] anchor of each block as an index into the packed context (ascending)
    context_start: torch.Tensor  # [N] where the block's sequence starts in the packed context
    labels: torch.Tensor  # [N, B-1] token at a+k (0 where invalid)
    valid: torch.Tensor  # [N, B-1] a+k inside the sequence and loss_mask[a+k]
    teacher_index: torch.Tensor  # [N, B-1] row of last_hidden that predicts label k (a+k-1, clamped)
    last_hidden: torch.Tensor | None  # [L, H] target final hidden states (kl variant), else None
    scale: float  # 1.0; 0.0 for a padding micro-batch that only keeps ranks in step
    sample_indices: list = field(default_factory=list)  # dataset index of each packed sequence
    context_offsets: list = field(default_factory=list)  # [S+1] sequence s = context rows offsets[s]:offsets[s+1]
    block_offsets: list = field(default_factory=list)  # [S+1] sequence s = blocks offsets[s]:offsets[s+1]

    @property
    def ctx_len(self) -> int:  # context rows including padding (the mask's and the drafter's L)
        return self.target_hidden.shape[1]

    @property
    def num_tokens(self) -> int:  # real context tokens (what throughput counts)
        return self.context_offsets[-1] if self.context_offsets else self.ctx_len

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


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack_sequences(input_ids: list[torch.Tensor], loss_mask: list[torch.Tensor], hidden: list[torch.Tensor],
                   anchors: list[torch.Tensor], block_size: int, mask_token_id: int,
                   last_hidden: list[torch.Tensor] | None = None, scale: float = 1.0,
                   sample_indices: list[int] | None = None, pad_multiple: int = 1) -> PackedBlocks:
    """Lay out S sequences and their blocks (anchors: positions within each sequence, ascending) in one pass.

    Index tensors are built on the device of ``input_ids``; features stay on their own device.
    """
    B = int(block_size)
    lens = [int(t.numel()) for t in input_ids]
    if min(lens, default=0) < 1:
        raise ValueError("every packed sequence needs at least one token")
    ids = torch.cat([t.reshape(-1).long() for t in input_ids])
    mask = torch.cat([m.reshape(-1).bool() for m in loss_mask]).to(ids.device)
    dev = ids.device
    offsets = _offsets(lens)
    counts = [int(a.numel()) for a in anchors]
    for a, n in zip(anchors, lens):
        if a.numel() and (int(a.min()) < 0 or int(a.max()) >= n):
            raise ValueError(f"anchors {a.tolist()} outside the sequence of {n} tokens")
    # each block's sequence: where it starts and ends in the packed context, and the anchor within it
    seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(counts, device=dev))
    start = torch.tensor(offsets[:-1], device=dev)[seq]
    end = torch.tensor(offsets[1:], device=dev)[seq]
    local = torch.cat([a.reshape(-1).long().to(dev) for a in anchors]) if anchors else torch.zeros(0, dtype=torch.long)
    # padding: whole blocks so that N*B is a multiple of pad_multiple (at least one block), then the context
    n_total = _round_up(max(1, local.numel()), pad_multiple // math.gcd(pad_multiple, B))
    L = _round_up(offsets[-1], pad_multiple)
    block_ids, labels, valid, teacher = _block_tensors(ids, mask, start, end, local, B, n_total, mask_token_id)
    k = torch.arange(B, device=dev)
    zeros = torch.zeros(n_total - local.numel(), dtype=torch.long, device=dev)  # padding blocks: anchor = start = 0
    ctx_pos = torch.cat([torch.arange(n, device=dev) for n in lens] + [torch.zeros(L - offsets[-1], dtype=torch.long,
                                                                                   device=dev)])
    blk_pos = torch.cat([local[:, None] + k[None, :], zeros[:, None] + k[None, :]])
    return PackedBlocks(target_hidden=_end_to_end(hidden, lens, L)[None], block_ids=block_ids.reshape(1, -1),
                        position_ids=torch.cat([ctx_pos, blk_pos.reshape(-1)])[None],
                        anchors=torch.cat([start + local, zeros]), context_start=torch.cat([start, zeros]),
                        labels=labels, valid=valid, teacher_index=teacher,
                        last_hidden=None if last_hidden is None else _end_to_end(last_hidden, lens, L),
                        scale=float(scale), sample_indices=list(sample_indices or [-1] * len(lens)),
                        context_offsets=offsets, block_offsets=_offsets(counts))


def _offsets(sizes: list[int]) -> list[int]:
    """[0, s0, s0 + s1, ...]: where each of consecutive runs of ``sizes`` starts, then where the last ends."""
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return offsets


def _block_tensors(ids: torch.Tensor, mask: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                   local: torch.Tensor, B: int, n_total: int, mask_token_id: int):
    """Per block, the real ones (``local``: their anchors within their sequences) then padding up to ``n_total``:
    the ids [n_total, B] (anchor token, MASK x (B-1)), labels, valid and teacher rows [n_total, B-1]."""
    dev, n_real = ids.device, local.numel()
    pos = (start + local)[:, None] + torch.arange(B, device=dev)[None, :]  # [n, B] packed indices of block tokens
    safe = torch.minimum(pos, end[:, None] - 1)
    inside = pos[:, 1:] < end[:, None]
    block_ids = torch.full((n_total, B), int(mask_token_id), dtype=torch.long, device=dev)
    block_ids[:n_real, 0] = ids[start + local]
    labels = torch.zeros(n_total, B - 1, dtype=torch.long, device=dev)
    labels[:n_real] = torch.where(inside, ids[safe[:, 1:]], torch.zeros_like(safe[:, 1:]))
    valid = torch.zeros(n_total, B - 1, dtype=torch.bool, device=dev)
    valid[:n_real] = inside & mask[safe[:, 1:]]
    teacher = torch.zeros(n_total, B - 1, dtype=torch.long, device=dev)
    teacher[:n_real] = safe[:, :-1]
    return block_ids, labels, valid, teacher


def _end_to_end(features: list[torch.Tensor], lens: list[int], rows: int) -> torch.Tensor:
    """The sequences' features [n, D] end to end, zero rows appended up to ``rows``."""
    packed = torch.cat([h.reshape(n, -1) for h, n in zip(features, lens)])
    if rows > packed.shape[0]:
        packed = torch.cat([packed, packed.new_zeros(rows - packed.shape[0], packed.shape[1])])
    return packed


@dataclass(frozen=True)
class CollateOptions:
    """How ``collate_blocks`` makes a micro-batch's blocks from samples, for a whole run (an epoch's draw, or the
    held-out anchors): the block, the anchors drawn, truncation, and which features are kept."""

    block_size: int  # tokens per block: the anchor and B-1 draft positions
    mask_token_id: int  # the id of the B-1 masked positions of every block
    num_anchors: int  # anchors per sample (at most; held-out: per sample, fixed)
    seed: int  # the run's seed: with the epoch and the sample's index it fixes the anchors
    epoch: int = 0  # the epoch whose anchors are drawn (unused with fixed_anchors)
    max_length: int | None = None  # samples are truncated to their first max_length tokens
    use_last_hidden: bool = False  # keep the target's final hidden states (kl loss, target_argmax labels)
    fixed_anchors: bool = False  # the held-out anchors (train/anchors.eval_anchors) instead of a per-epoch draw
    # > 0: each sample draws round(anchor_density * its tokens) anchors instead of num_anchors
    # (train/anchors.anchor_count; held-out anchors keep num_anchors)
    anchor_density: float = 0.0


def collate_blocks(samples: list[dict], options: CollateOptions, *, check_finite: bool = True, scale: float = 1.0,
                   pad_multiple: int = PAD_MULTIPLE) -> PackedBlocks:
    """One packed micro-batch from per-sample dicts: truncate, check, draw each sample's anchors (``options``),
    pack.

    Each dict holds ``input_ids`` [T] and ``loss_mask`` [T] (on the CPU), ``hidden`` [T, K*H] (any device),
    ``last_hidden`` [T, H] (needed when ``options.use_last_hidden``) and ``index`` (the sample's dataset index: it
    keys the anchors, so the same sample draws the same anchors however it is packed). ``check_finite`` looks for
    NaN/Inf in the features (stored shards; it costs a host sync when the features live on a GPU). ``scale``:
    the micro-batch's weight (0 for a padding one).
    """
    block_size, num_anchors, seed = options.block_size, options.num_anchors, options.seed
    max_length, use_last_hidden = options.max_length, options.use_last_hidden
    if not samples:
        raise ValueError("collate_blocks needs at least one sample")
    ids_l, mask_l, hid_l, last_l, anc_l, index_l = [], [], [], [], [], []
    for s in samples:
        index = int(s["index"])
        ids, mask, hidden = s["input_ids"].reshape(-1), s["loss_mask"].reshape(-1), s["hidden"]
        last = s.get("last_hidden") if use_last_hidden else None
        if use_last_hidden and last is None:
            raise UserError(f"sample {index} has no last_hidden: the kl loss needs shards extracted with "
                            f"last_hidden; re-extract, or use loss=dpace (the default) or ce")
        if max_length and ids.numel() > max_length:
            ids, mask, hidden = ids[:max_length], mask[:max_length], hidden[:max_length]
            last = None if last is None else last[:max_length]
        if check_finite:
            for name, t in (("hidden", hidden), ("last_hidden", last)):
                if t is not None and not torch.isfinite(t).all():
                    raise UserError(f"sample {index}: NaN or Inf in the stored features (field {name}); "
                                    f"re-extract that shard (dflashkit verify names it)")
        if options.fixed_anchors:
            anchors = eval_anchors(mask, block_size, num_anchors, seed, index)
        else:
            anchors = sample_anchors(mask, anchor_count(ids.numel(), num_anchors, options.anchor_density),
                                     sample_generator(seed, options.epoch, index))
        ids_l.append(ids), mask_l.append(mask), hid_l.append(hidden), last_l.append(last)
        anc_l.append(anchors), index_l.append(index)
    return pack_sequences(ids_l, mask_l, hid_l, anc_l, block_size, options.mask_token_id,
                          last_l if use_last_hidden else None, scale, index_l, pad_multiple)


def pack_order(order: list[int], lengths, micro_batch_tokens: int, max_length: int | None = None) -> list[list[int]]:
    """Consecutive samples of ``order`` grouped greedily into micro-batches of at most ``micro_batch_tokens``
    tokens (``lengths[i]``, capped at ``max_length``); a longer sample alone; 0 -> one sample each."""
    packs: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = int(lengths[i]) if not max_length else min(int(lengths[i]), int(max_length))
        if cur and (micro_batch_tokens <= 0 or used + n > micro_batch_tokens):
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        packs.append(cur)
    return packs


# --------------------------------------------------------------------------- split and order
def split_indices(num_samples: int, eval_samples: int, seed: int,
                  source: str = "the data") -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices; the held-out set is fixed by the seed. ``source`` names the data in
    the error when there is nothing to train on."""
    if num_samples == 0:
        raise UserError(f"{source}: no sample to train on (0 samples: every record was skipped or the data is "
                        f"empty; the counts of skipped records say why); give data that holds usable samples")
    if eval_samples >= num_samples:
        raise UserError(f"eval_samples={eval_samples} leaves no training data ({num_samples} samples); "
                        f"set eval_samples below {num_samples}")
    perm = torch.randperm(num_samples, generator=sample_generator(seed, 0xE7A1)).tolist()
    return sorted(perm[eval_samples:]), sorted(perm[:eval_samples])


def epoch_order(train: list[int], seed: int, epoch: int) -> list[int]:
    perm = torch.randperm(len(train), generator=sample_generator(seed, 0x0DE5, epoch)).tolist()
    return [train[i] for i in perm]


def steps_per_epoch(num_micro_batches: int, world_size: int, grad_accum: int) -> int:
    return math.ceil(num_micro_batches / (world_size * grad_accum))


def rank_slots(order: list, start: int, world_size: int, grad_accum: int, rank: int) -> list[tuple[object, bool]]:
    """(item, is_padding) for every micro-batch of this rank from position ``start`` to the epoch end; an item is
    whatever ``order`` holds (a sample index, or a list of them from ``pack_order``)."""
    per_step = world_size * grad_accum
    if start % per_step:
        raise UserError(f"resume position {start} is not a multiple of world_size*grad_accum={per_step}; "
                        f"resume with the world size, grad_accum and micro_batch_tokens of the checkpointed run")
    out = []
    for base in range(start, len(order), per_step):
        for j in range(grad_accum):
            slot = base + j * world_size + rank
            out.append((order[slot], False) if slot < len(order) else (order[slot % len(order)], True))
    return out


# --------------------------------------------------------------------------- samples -> packed blocks
class BlockSource(torch.utils.data.Dataset):
    """Map-style view over a list of slots: item i = the packed micro-batch of slot i (DataLoader-friendly).
    A slot is (sample index or list of sample indices, is_padding)."""

    def __init__(self, dataset, slots: list[tuple[object, bool]], options: CollateOptions):
        self.dataset, self.slots, self.options = dataset, slots, options

    def __len__(self):
        return len(self.slots)

    def __getitem__(self, i: int) -> PackedBlocks:
        item, padding = self.slots[i]
        pack = [item] if isinstance(item, int) else list(item)
        samples = [{**self.dataset[index], "index": index} for index in pack]
        return collate_blocks(samples, self.options, scale=0.0 if padding else 1.0)


def _identity(x):
    return x


def block_loader(source: BlockSource, num_workers: int = 0, pin_memory: bool = False):
    """An iterator over the packed micro-batches of ``source`` in order (workers prefetch)."""
    return iter(torch.utils.data.DataLoader(source, batch_size=None, shuffle=False, num_workers=num_workers,
                                            pin_memory=pin_memory, collate_fn=_identity,
                                            persistent_workers=False))
