"""DSpark block drafter: the DFlash drafter plus a low-rank Markov head and a confidence head.

DSpark (arXiv 2607.05147, reference code deepseek-ai/DeepSpec) keeps DFlash's parallel pass and adds a sequential
stage: the draft tokens of a block are chosen left to right, position k's logits being the backbone's plus a bias
that depends on the token chosen at position k-1. Self-contained like ``modeling_dflash.py`` (torch + transformers
and that sibling file only); an export ships both, so ``AutoModel.from_pretrained(dir, trust_remote_code=True)``
loads the drafter, ``spec_generate`` included, without dflashkit.

Design choices:
- Layout: the block dflashkit trains for DFlash, 1 + N positions: the anchor (the last verified token) at offset 0,
  MASK at offsets 1..N (N = block_size - 1), the final state at offset k predicting the token at offset k. The
  reference trains another layout (N positions, anchor + N-1 masks, offset k predicting offset k+1). vLLM 0.26
  serves both and picks by ``dspark_bonus_anchor`` (v1/worker/gpu/spec_decode/dspark/speculator.py:43-51; the
  inputs kernel dflash/speculator.py:555-564): true queries 1 + N tokens and samples offsets 1..N, each at its own
  position, exactly the block trained here, so the export writes it true. In both layouts the first position's
  predecessor is the anchor (speculator.py:113-115).
- Markov head (the reference's "vanilla" head): ``bias(prev) = markov_w2(markov_w1[prev])``, ``markov_w1`` an
  embedding of the whole vocabulary into rank r, ``markov_w2`` a linear r -> vocabulary without bias: a rank-r
  transition matrix B = W1 W2 (paper eq. 5). Training adds it with the true previous tokens (teacher forcing,
  ``block_logits``); drafting adds it with the tokens just chosen (``markov_greedy``, ``markov_sample``).
- Confidence head: ``c_k = sigmoid(proj([h_k ; markov_w1[x_{k-1}]]))`` (paper eq. 7; ``proj`` a linear to one
  logit with a bias; without ``confidence_head_with_markov`` the features are h_k alone). It estimates whether
  draft k survives verification given that every draft before it did; vLLM 0.26 skips its weights
  (qwen3_dspark.py:172-176), so it only shortens what dflashkit's own decoding verifies.
- A fresh drafter proposes exactly like DFlash: ``markov_w2`` starts at zero (every bias 0; its gradient is not,
  so training moves it); the reference starts both factors random, which only changes where training starts.
- Config fields (top level, as the reference and vLLM 0.26 name them): ``markov_rank`` (required, >= 1),
  ``enable_confidence_head`` and ``confidence_head_with_markov`` (default true). Only the full-vocabulary head is
  implemented: a ``draft_vocab_size`` other than ``vocab_size``, another ``markov_head_type`` than "vanilla" and
  a logit scale or soft-cap (vLLM 0.26's DSpark reader applies only ``logit_scale`` to both terms,
  qwen3_dspark.py:111-119) are refused when the model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from .modeling_dflash import UNSUPPORTED, DFlashDraftModel, filtered_probs

# besides DFlash's: a logit multiplier or soft-cap would change the base logits the Markov bias is added to
DSPARK_UNSUPPORTED = {**UNSUPPORTED, "output_multiplier": 1.0, "final_logit_softcapping": None, "logit_scale": 1.0}


class MarkovHead(nn.Module):
    """The low-rank transition bias: ``markov_w1`` [V, r] embeds the previous token, ``markov_w2`` maps r -> V."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """markov_w1[prev_ids]: [...] -> [..., r]."""
        return self.markov_w1(prev_ids.long())

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """The bias each vocabulary entry gets after ``prev_ids``: [...] -> [..., V]."""
        return self.markov_w2(self.embed(prev_ids))


class ConfidenceHead(nn.Module):
    """One logit per draft position from its features (``proj``: a linear to 1 with a bias)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


def markov_greedy(base_logits: torch.Tensor, anchor_ids: torch.Tensor, markov_head: MarkovHead) -> torch.Tensor:
    """The greedy draft of a block: ``tokens[:, k] = argmax(base_logits[:, k] + bias(tokens[:, k-1]))``, the
    predecessor of position 0 being the anchor; base_logits [b, P, V], anchor_ids [b] -> tokens [b, P]. The order
    of vLLM 0.26's greedy path (dspark/speculator.py:115-148): bias from the previous token, added, argmax."""
    prev = anchor_ids.long()
    tokens = []
    for k in range(base_logits.shape[1]):
        prev = (base_logits[:, k] + markov_head(prev)).argmax(dim=-1)
        tokens.append(prev)
    return torch.stack(tokens, dim=1) if tokens else anchor_ids.new_zeros((anchor_ids.shape[0], 0)).long()


def markov_sample(base_logits: torch.Tensor, anchor_ids: torch.Tensor, markov_head: MarkovHead,
                  temperature: float, top_p: float = 1.0, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled draft of a block, left to right like ``markov_greedy``: each position drawn from the filtered
    distribution of its biased logits. Returns (tokens [b, P], the distributions drawn from [b, P, V]), the
    latter for the rejection rule, since each depends on the tokens drawn before it."""
    prev = anchor_ids.long()
    tokens, probs = [], []
    for k in range(base_logits.shape[1]):
        p = filtered_probs(base_logits[:, k] + markov_head(prev), temperature, top_p, top_k)
        prev = torch.multinomial(p, 1)[:, 0]
        tokens.append(prev)
        probs.append(p)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


class DSparkDraftModel(DFlashDraftModel):
    """``DFlashDraftModel`` (same forward arguments and output) with ``markov_head`` and ``confidence_head``."""

    unsupported = DSPARK_UNSUPPORTED

    def __init__(self, config):
        super().__init__(config)
        rank = getattr(config, "markov_rank", None)
        if rank is None or int(rank) < 1:
            raise ValueError(f"markov_rank={rank!r}: a DSpark drafter needs a Markov head of rank >= 1")
        kind = getattr(config, "markov_head_type", "vanilla")
        if kind != "vanilla":
            raise ValueError(f"markov_head_type={kind!r}: this file implements the 'vanilla' Markov head only")
        draft_vocab = getattr(config, "draft_vocab_size", None)
        if draft_vocab not in (None, config.vocab_size):
            raise ValueError(f"draft_vocab_size={draft_vocab} differs from vocab_size={config.vocab_size}: "
                             f"a reduced draft vocabulary is not implemented")
        self.markov_head = MarkovHead(config.vocab_size, int(rank))
        self.confidence_with_markov = bool(getattr(config, "confidence_head_with_markov", True))
        self.confidence_head = None
        if bool(getattr(config, "enable_confidence_head", True)):
            width = config.hidden_size + (int(rank) if self.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)
        self._init_heads()

    def _init_heads(self) -> None:
        """The heads' start: markov_w1 and the confidence projection random (the backbone's std), markov_w2 and
        the projection's bias zero, so every Markov bias is 0 and a fresh drafter proposes like DFlash."""
        std = getattr(self.config, "initializer_range", 0.02)
        with torch.no_grad():
            nn.init.normal_(self.markov_head.markov_w1.weight, mean=0.0, std=std)
            nn.init.zeros_(self.markov_head.markov_w2.weight)
            if self.confidence_head is not None:
                nn.init.normal_(self.confidence_head.proj.weight, mean=0.0, std=std)
                nn.init.zeros_(self.confidence_head.proj.bias)

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, dspark_targets: dict | None = None, **kwargs):
        """DFlash's forward (returns the final hidden states); with ``dspark_targets`` (training) it returns
        ``(hidden, dspark_targets["term"](hidden, self))``: the training term, which reads the Markov and
        confidence heads, runs inside the one forward call, so a DDP- or FSDP-wrapped drafter uses every
        parameter within its forward."""
        hidden = super().forward(position_ids, attention_mask=attention_mask, noise_embedding=noise_embedding,
                                 target_hidden=target_hidden, past_key_values=past_key_values, use_cache=use_cache,
                                 **kwargs)
        if dspark_targets is None:
            return hidden
        return hidden, dspark_targets["term"](hidden, self)

    def block_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Teacher-forced logits of draft positions: the backbone's logits of ``hidden`` [..., H] plus the Markov
        bias of ``prev_ids`` [...] (the true token before each position) -> [..., V]."""
        return self.compute_logits(hidden, lm_head) + self.markov_head(prev_ids)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit per draft position (float32, as the reference computes it): hidden
        [..., H] and the token before each position [...] -> [...]; sigmoid of it is c_k."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head is false)")
        features = hidden
        if self.confidence_with_markov:
            features = torch.cat([hidden, self.markov_head.embed(prev_ids).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features).float()

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The greedy draft of a block from the final states of its draft positions ([b, P, H]) -> [b, P]."""
        return markov_greedy(self.compute_logits(hidden, lm_head), anchor_ids, self.markov_head)

    def draft_tokens(self, hidden, anchor_ids, head, temperature: float, top_p: float, top_k: int):
        """``spec_generate``'s draft of one block, chosen left to right with the Markov bias (greedy, or sampled
        with the distributions each draw came from)."""
        base = self.compute_logits(hidden, head)
        if temperature <= 0:
            return markov_greedy(base, anchor_ids, self.markov_head), None
        return markov_sample(base, anchor_ids, self.markov_head, temperature, top_p, top_k)
