"""DFlash2 block drafter: the DFlash drafter plus an in-block convolution in every layer and a candidate selector.

Self-contained like ``modeling_dflash.py`` (torch + transformers and that sibling file only); the export ships
both, so ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` loads a DFlash2 drafter without dflashkit.
The layout and the maths are those of the reference ``dflash.DFlash2DraftModel`` (PyPI ``dflash`` 0.1.0); the
parameter names are the ones it loads (``layers.{i}.{attention,mlp}_conv.base_kernel``,
``layers.{i}.{attention,mlp}_conv.kernel_projection.weight``, ``candidate_selector.predecessor_codebook``,
``candidate_selector.successor_codebook`` (no ``.weight``), ``candidate_selector.hidden_projection.weight``).

API (stable; eval/ and train/ build on it):
- ``grouped_dynamic_causal_conv(hidden, dynamic, base, group_size, block_size)``: the convolution along the
  block's positions. ``hidden`` [b, Q, H]; ``dynamic`` [b, Q, K, H/group_size] (per position, tap and channel
  group); ``base`` [K, H]. ``out[t] = sum_o (base[o] + dynamic[t, o]) * hidden[t - o]`` over taps o < K, causal and
  zero-padded at the start of each block: Q <= block_size is one block (a decoding step, possibly short), a
  longer Q must be a whole number of blocks laid end to end (training packs N blocks of block_size).
- ``GroupedDynamicCausalConv(hidden_size, kernel_size, group_size)``: ``prepare(x, block_size)`` convolves a
  sublayer's input x with the first kernel set and returns ``(convolved, dynamic2)``, the second set's dynamic
  taps, both predicted from x by ``kernel_projection``; ``finish(y, dynamic2, block_size)`` convolves the
  sublayer's output y. A layer does ``x = norm(h); x, d = conv.prepare(x); h = h + conv.finish(sublayer(x), d)``
  around its attention (``attention_conv``) and its MLP (``mlp_conv``). Both convolve with ``conv_fn``
  (``grouped_dynamic_causal_conv``; a trainer may set another way to the same values, e.g. dflashkit's kernels).
- ``CandidateSelector(vocab_size, hidden_size, rank, top_k)``: ``pair_scores(hidden, unary, candidate_ids,
  predecessor_ids, pair_term=None)`` = ``unary + <predecessor_codebook[prev] * hidden_projection(h),
  successor_codebook[cand]>`` for any leading shape (training scores every position at once with the true
  previous token; ``pair_term``, a trainer's other way to the inner product, e.g. dflashkit's kernel);
  ``select(hidden, logits, anchor_ids, temperature=0.0) -> (tokens [b, P], candidate_ids [b, P, top_k],
  probs [b, P, top_k] or None)`` walks the P draft positions left to right, the predecessor of position 1 being
  the anchor token, each later one the token just chosen: greedy takes the argmax of the scores (the reference's
  rule), temperature > 0 samples from their softmax.
- ``DFlash2DraftModel``: ``DFlashDraftModel`` (same forward arguments and output) with ``DFlash2DecoderLayer``s
  and ``candidate_selector``; ``propose(hidden, anchor_ids, lm_head, temperature=0.0)`` = ``select`` on the
  model's logits (hidden = the final states of draft positions 1..B-1); ``spec_generate`` drafts with it;
  ``forward(..., selector_targets={candidates, predecessor_ids})`` also returns the teacher-forced training
  scores (``selector_scores``); ``candidates(draft, top_k)`` hands back each draft position's top_k logits and
  token ids (dflashkit's trainer passes its loss pass, which takes them from the logits it computes anyway).

A fresh drafter starts as plain DFlash: every convolution is the identity (unit tap 0, no dynamic part) and the
successor codebook is zero, so every selector score is the drafter's own logit; training moves them from there.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_dflash import UNSUPPORTED, DFlashDecoderLayer, DFlashDraftModel, dflash_field

# the config fields (dflash_config or top level) this file implements; all four are required
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def grouped_dynamic_causal_conv(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                                block_size: int) -> torch.Tensor:
    """Causal depthwise convolution along each block's positions with per-position taps (module docstring).

    Vectorised over blocks (a [b, Q] run becomes [b*N, B] rows); the loop is over the K taps only, and the
    operations per tap are the reference's, so a single block gives its result exactly. Tap o reads the block
    rolled by o positions with its first o zeroed (the reference pads instead: the same values); compiled for
    training, the roll is recomputed in the backward where the padded copies were kept, 3 activations a layer
    fewer at the testbed's shape."""
    b, q, h = hidden.shape
    groups = h // group_size
    taps = base.shape[0]
    seg = q if q <= block_size else block_size
    if q % seg:
        raise ValueError(f"{q} block positions are not a whole number of blocks of block_size={block_size}")
    x = hidden.reshape(b * (q // seg), seg, groups, group_size)
    dyn = dynamic.reshape(b * (q // seg), seg, taps, groups, 1).to(x.dtype)
    position = torch.arange(seg, device=x.device).view(1, seg, 1, 1)
    out = torch.zeros_like(x)
    for offset in range(min(taps, seg)):  # a tap past the block's length reads only zero padding
        values = x if offset == 0 else torch.where(position >= offset, torch.roll(x, offset, dims=1), 0)
        out = out + base[offset].view(1, 1, groups, group_size).to(x.dtype) * values
        out = torch.addcmul(out, dyn[:, :, offset], values)
    return out.view_as(hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer: base taps ``base_kernel`` [2, K, H] plus dynamic taps predicted
    from the sublayer's input, one per position, tap and group of ``group_size`` channels."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_kernel_size={kernel_size} must be >= 1 and conv_group_size={group_size} must "
                             f"divide hidden_size={hidden_size}")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        # the convolution itself: a trainer may point this at another way to the same values (dflashkit's kernels)
        self.conv_fn: Callable = grouped_dynamic_causal_conv
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 is 1, the other taps and the dynamic part 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, hidden: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            # mixed-precision training: the norm hands over float32 (its float32 weight); the sublayer's matmuls
            # would read this in the autocast dtype anyway, so convolve it there too, as a bf16 drafter serves:
            # half the bytes the convolution reads, writes and keeps for its backward
            hidden = hidden.to(torch.get_autocast_dtype(device))
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.groups)
        out = self.conv_fn(hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_size)
        return out, dynamic[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        return self.conv_fn(hidden, dynamic, self.base_kernel[1], self.group_size, block_size)


class _AutocastRows(torch.autograd.Function):
    """``F.embedding(ids, weight)`` as autocast's matmul receives it, in ``dtype``: the rows are gathered from the
    weight cast once (a cast commutes with a gather), instead of gathering float32 rows that the matmul then casts;
    the backward is ``F.embedding``'s on the gradient upcast to the weight's dtype and laid out contiguously in
    that one copy (the matmul's gradient arrives transposed, and the embedding's backward would copy it again).
    The same values and gradients, with less memory traffic."""

    @staticmethod
    def forward(ctx, ids, weight, dtype):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.weight_dtype = weight.shape[0], weight.dtype
        return F.embedding(ids, weight.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad = grad.to(ctx.weight_dtype, memory_format=torch.contiguous_format)
        return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.rows, -1, False), None


def codebook_rows(ids: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, codebook)`` for a matmul operand; under autocast of a float32 codebook, the rows
    already in autocast's dtype (``_AutocastRows``: the values the matmul would have cast them to)."""
    dev = codebook.device.type
    if codebook.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        if dtype != torch.float32:
            return _AutocastRows.apply(ids, codebook, dtype)
    return F.embedding(ids, codebook)


def gathered_pair_term(gate: torch.Tensor, ids: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """<gate, codebook[ids]> over the rank, the reference's way: the rows gathered, then one batched matmul.
    gate [..., r], ids [..., k], codebook [V, r] -> [..., k]."""
    return torch.einsum("...r,...kr->...k", gate, codebook_rows(ids, codebook))


class CandidateSelector(nn.Module):
    """Low-rank pairwise scores over each draft position's ``top_k`` candidates (module docstring).

    The codebooks are bare parameters, so their tensor names carry no ``.weight``, as the reference's files."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_rank={rank} must be >= 1 and selector_top_k={top_k} in 1..{vocab_size}")
        self.rank = rank
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Scores = the drafter's logits: a zero successor codebook (it still gets a gradient at once)."""
        with torch.no_grad():
            self.predecessor_codebook.normal_(0.0, std)
            self.successor_codebook.zero_()
            self.hidden_projection.weight.normal_(0.0, std)

    def pair_scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidate_ids: torch.Tensor,
                    predecessor_ids: torch.Tensor, pair_term: Callable | None = None) -> torch.Tensor:
        """unary [..., k] + <A[prev] * W h, B[cand]> for hidden [..., H], candidate_ids [..., k], prev [...].
        ``pair_term(gate, candidate_ids, codebook)``: another way to ``gathered_pair_term`` (a trainer's kernel)."""
        gate = F.embedding(predecessor_ids, self.predecessor_codebook) * self.hidden_projection(hidden)
        return unary + (pair_term or gathered_pair_term)(gate, candidate_ids, self.successor_codebook)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
               temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Walk the draft positions left to right (module docstring); hidden [b, P, H], logits [b, P, V],
        anchor_ids [b]. The per-step arithmetic is the reference's ``CandidateSelector.select``."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        predecessor = anchor_ids
        path, prob_rows = [], []
        for position in range(hidden.shape[1]):
            scores = unary[:, position] + torch.einsum(
                "br,bkr->bk", F.embedding(predecessor, self.predecessor_codebook) * projected[:, position],
                F.embedding(candidates[:, position], self.successor_codebook))
            if temperature > 0:
                probs = torch.softmax(scores.float() / temperature, dim=-1)
                index = torch.multinomial(probs, 1)[:, 0]
                prob_rows.append(probs)
            else:
                index = torch.argmax(scores, dim=-1)
            predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, 1), candidates, (torch.stack(prob_rows, 1) if prob_rows else None)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer whose attention and MLP inputs and outputs pass the in-block convolutions."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        kernel, group = int(dflash_field(config, "conv_kernel_size")), int(dflash_field(config, "conv_group_size"))
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, kernel, group)
        self.block_size = int(dflash_field(config, "block_size", 16))  # the convolutions never cross blocks

    def forward(self, block, context, cos, sin, attention_mask=None, past_key_values=None):
        x, dynamic = self.attention_conv.prepare(self.input_layernorm(block), self.block_size)
        x = self.self_attn(x, context, cos, sin, attention_mask, past_key_values)
        block = block + self.attention_conv.finish(x, dynamic, self.block_size)
        x, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(block), self.block_size)
        return block + self.mlp_conv.finish(self.mlp(x), dynamic, self.block_size)


class DFlash2DraftModel(DFlashDraftModel):
    _no_split_modules = ["DFlash2DecoderLayer"]
    decoder_layer_cls = DFlash2DecoderLayer
    unsupported = {k: v for k, v in UNSUPPORTED.items() if k not in DFLASH2_FIELDS}

    def __init__(self, config):
        missing = [k for k in DFLASH2_FIELDS if not dflash_field(config, k)]
        if missing:
            raise ValueError(f"config lacks the DFlash2 field(s) {missing} (dflash_config or top level); a "
                             f"DFlash2 drafter needs all of {list(DFLASH2_FIELDS)}")
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size,
                                                    int(dflash_field(config, "selector_rank")),
                                                    int(dflash_field(config, "selector_top_k")))
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
            module.reset_parameters()  # after their Linear children: the identity start (module docstring)

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, selector_targets: dict | None = None, **kwargs):
        """The reference's forward (returns the final hidden states); with ``selector_targets`` (training) it
        returns ``(hidden, (scores, candidate_ids))`` from ``selector_scores``, inside the one forward call, so a
        DDP- or FSDP-wrapped drafter computes every parameterised term within its forward (the ``candidates``
        function, which holds no parameter of the drafter, runs there too)."""
        hidden = super().forward(position_ids, attention_mask=attention_mask, noise_embedding=noise_embedding,
                                 target_hidden=target_hidden, past_key_values=past_key_values, use_cache=use_cache,
                                 **kwargs)
        if selector_targets is None:
            return hidden
        return hidden, self.selector_scores(hidden, **selector_targets)

    def selector_scores(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor,
                        candidates: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
                        pair_term: Callable | None = None, hidden_grad: bool = True):
        """Teacher-forced selector scores of packed training blocks: hidden [1, N*B, H] (the forward's output),
        predecessor_ids [N, B-1] (the token before each draft position: the anchor, then the true tokens).

        ``candidates(draft [N, B-1, H], top_k) -> (logits [N, B-1, top_k], ids [N, B-1, top_k])``: the top_k of the
        frozen lm_head's logits of the draft positions; logits that carry a gradient pass it on to ``draft`` (the
        public DFlash2 trainers' coupling; dflashkit's ``selector_unary_grad``). dflashkit's trainer passes its block
        loss here (train/drafter_pass.py), which takes them from the logits it computes anyway, chunk by chunk,
        so the lm_head runs once per position (a separate lm_head pass for them cost DFlash2 ~30% of its training
        throughput). The pairwise term carries the gradient (codebooks, hidden_projection and, through it, the
        drafter's hidden states), and the unary term where its logits have one. ``pair_term``: ``pair_scores``'s.
        ``hidden_grad=False``: the pairwise term reads the hidden states detached, so its gradient stops at the
        codebooks and hidden_projection (dflashkit's ``selector_hidden_grad``).
        Returns (scores [N, B-1, top_k] float32, candidate_ids [N, B-1, top_k])."""
        n, p = predecessor_ids.shape
        draft = hidden.reshape(n, p + 1, -1)[:, 1:]
        unary, ids = candidates(draft, self.candidate_selector.top_k)
        scores = self.candidate_selector.pair_scores(draft if hidden_grad else draft.detach(), unary.to(draft.dtype),
                                                     ids, predecessor_ids, pair_term)
        return scores.float(), ids

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: nn.Module, temperature: float = 0.0):
        """The block's draft tokens from the final states of draft positions 1..B-1 (``CandidateSelector.select``
        on this drafter's logits): (tokens [b, B-1], candidate_ids, probs or None)."""
        return self.candidate_selector.select(hidden, self.compute_logits(hidden, lm_head), anchor_ids, temperature)

    def draft_tokens(self, hidden, anchor_ids, head, temperature: float, top_p: float, top_k: int):
        """spec_generate's drafting step: the selector's path; sampled, its distribution over the candidates
        scattered into the vocabulary (top_p / top_k apply to the target only, as in the reference)."""
        logits = self.compute_logits(hidden, head)
        tokens, candidates, probs = self.candidate_selector.select(hidden, logits, anchor_ids, temperature)
        if probs is None:
            return tokens, None
        return tokens, torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, candidates, probs)


__all__ = ["CandidateSelector", "DFlash2DecoderLayer", "DFlash2DraftModel", "GroupedDynamicCausalConv",
           "gathered_pair_term", "grouped_dynamic_causal_conv"]
