"""DSpark: the DFlash drafter plus a low-rank Markov head and a confidence head (drafter/modeling_dspark.py; arXiv
2607.05147, reference deepseek-ai/DeepSpec).

- Config: one whole-number field of its own, ``markov_rank`` (the rank r of the transition bias; 256, the
  paper's). The confidence head is always built, reading the Markov embedding too (the paper's and the
  reference's defaults). config.json also carries, at the top level where vLLM 0.26 reads them
  (``dspark_json_fields``): ``markov_rank`` (qwen3_dspark.py:84-92), ``dspark_bonus_anchor: true`` (the 1 + N
  block dflashkit trains: the anchor then N masks, each sampled at its own position; dspark/speculator.py:43-51),
  ``dspark_block_size`` = block_size - 1 unless every layer is causal (vLLM then refuses fewer speculative tokens,
  config/speculative.py:1004-1027: with a non-causal layer a shorter block changes every draft), and the
  reference's names of the heads' settings. ``architectures`` is ``Qwen3DSparkModel``, the name vLLM picks method
  "dspark" from (config/speculative.py:882-887); ``auto_map`` points at ``DSparkDraftModel`` in the shipped
  ``modeling_dspark.py``. The weights are the model's own names (``markov_head.*``, ``confidence_head.*`` beside
  DFlash's); vLLM shares the target's embedding and lm_head and skips the confidence head (qwen3_dspark.py:149-185).
- Proposal: left to right with the Markov bias of the token just chosen (``markov_proposal``), vLLM 0.26's greedy
  rule (dspark/speculator.py:115-148); sampled decoding draws the same way (``markov_sampled_path``).
- Loss: ``dspark`` (train/dspark_loss.py): 0.1 CE + 0.9 L1(p_draft, p_target) + the confidence head's BCE on the
  acceptance probability, decay weights; it replaces the block loss (the paper's objective alone), whose pass
  still gives the backbone's metrics. Options: ``DSparkLossOptions``.
- Confidence: ``confidence_logits`` (the head's logit per draft); ``dflashkit eval --confidence-threshold``
  verifies each round's drafts up to the first below it (eval/confidence_cut.py).
- Capabilities: chains, and in dflashkit's own evaluator trees too, each node's children drawn from its depth's
  logits plus the Markov bias of the node's token (``markov_node_bias``, eval/tree.py; vLLM drafts DSpark as a
  chain); drafts no longer block than trained
  (the export says ``dspark_block_size``, and the bias of a position past the trained block was never trained);
  vLLM 0.26 serves it (model runner V2 only). SGLang 0.5.17 reads the same tensor names but drafts the
  reference's N-position block (srt/speculative/dspark_components/dspark_draft.py:313-323, 369: the anchor's state
  predicting the first draft), which shifts every prediction of this 1 + N export by one position: not served.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dflashkit.errors import UserError

from ..modeling_dspark import DSparkDraftModel, markov_greedy
from .kind import DrafterKind, unwrapped

CONFIG_FIELDS = {"markov_rank": 256}  # rank r of the transition bias markov_w2(markov_w1[prev]); the paper's


def check_fields(config) -> None:
    """The bounds of the kind's field in a DrafterConfig; UserError naming it and the fix."""
    if int(config.markov_rank) < 1:
        raise UserError(f"markov_rank={config.markov_rank} must be >= 1 (the paper uses 256)")


def dspark_json_fields(config) -> dict:
    """config.json's DSpark fields (module docstring), at the top level where vLLM 0.26 and the reference read."""
    fields = {"markov_rank": int(config.markov_rank), "markov_head_type": "vanilla", "enable_confidence_head": True,
              "confidence_head_with_markov": True, "dspark_bonus_anchor": True}
    if not config.causal:  # a shorter block than trained would change every draft: vLLM refuses k < N
        fields["dspark_block_size"] = config.block_size - 1
    return fields


def markov_proposal(drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                    anchor_ids: torch.Tensor) -> torch.Tensor:
    """The greedy proposal of one block: logits [b, P, V] (the backbone's, draft positions 1..P) -> tokens [b, P],
    chosen left to right with the Markov bias of the token chosen before (``markov_greedy``)."""
    return markov_greedy(logits, anchor_ids, unwrapped(drafter).markov_head)


def markov_sampled_path(drafter: nn.Module, logits: torch.Tensor, anchor: int, probs_of,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled block: position by position, a draw from ``probs_of`` (the decoder's temperature / top-p /
    top-k filter) of the logits [P, V] plus the Markov bias of the token just drawn. Returns (tokens [P], the
    distributions drawn from [P, V]), the q of speculative sampling."""
    head = unwrapped(drafter).markov_head
    prev = torch.full((1,), anchor, dtype=torch.long, device=logits.device)
    tokens, rows = [], []
    for k in range(logits.shape[0]):
        probs = probs_of(logits[k:k + 1] + head(prev).to(logits.dtype))
        prev = torch.multinomial(probs, 1, generator=generator)[:, 0]
        tokens.append(prev)
        rows.append(probs)
    return torch.cat(tokens), torch.cat(rows)


def markov_node_bias(drafter: nn.Module, token: int) -> torch.Tensor:
    """The Markov bias [V] after ``token``: added to the logits of a tree node's children (eval/tree.py)."""
    head = unwrapped(drafter).markov_head
    return head(torch.tensor([token], device=head.markov_w1.weight.device))[0]


def confidence_logits(drafter: nn.Module, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
    """The confidence head's logit per draft position (sigmoid: c_k), hidden [P, H], prev_ids [P] -> [P]."""
    return unwrapped(drafter).confidence_logits(hidden, prev_ids)


@dataclass(frozen=True)
class DSparkLossOptions:
    """The weights of DSpark's training term (train/dspark_loss.py; the paper's eq. 12 defaults)."""

    ce_weight: float = 0.1  # alpha_ce: cross-entropy on the label
    tv_weight: float = 0.9  # alpha_tv: ||p_draft - p_target||_1; > 0 needs the target's logits
    confidence_weight: float = 1.0  # alpha_conf: the confidence head's BCE; > 0 needs the target's logits
    gamma: float = 7.0  # position decay exp(-(k-1)/gamma): DFlash's for block 16 (the reference uses 4 for block 7)

    def __post_init__(self):
        for name in ("ce_weight", "tv_weight", "confidence_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        if not self.gamma > 0:
            raise ValueError(f"gamma={self.gamma!r} must be > 0")

    @classmethod
    def from_settings(cls, settings) -> "DSparkLossOptions":
        """From a run's settings (a TrainConfig: its ``gamma``); None: the defaults."""
        return cls() if settings is None else cls(gamma=float(settings.gamma))

    def evaluation(self) -> "DSparkLossOptions":
        """Held-out evaluation's: the CE part alone (held-out samples carry no target distribution), which also
        gives the Markov draft's teacher-forced accuracy and accepted runs."""
        return dataclasses.replace(self, tv_weight=0.0, confidence_weight=0.0)

    @property
    def needs_target(self) -> bool:
        """Whether the term reads the target's distribution (the L1 or the confidence term is on)."""
        return self.tv_weight > 0 or self.confidence_weight > 0


DSPARK = DrafterKind(
    architecture="dspark", name="DSpark", class_name="Qwen3DSparkModel", model_class=DSparkDraftModel,
    modeling_files=("modeling_dflash.py", "modeling_dspark.py"),  # DSpark's imports DFlash's: both ship
    propose=markov_proposal, sample_path=markov_sampled_path, confidence=confidence_logits,
    config_fields=CONFIG_FIELDS,
    check_fields=check_fields, json_fields=dspark_json_fields,
    loss_term="dspark", loss_options=DSparkLossOptions.from_settings,
    node_bias=markov_node_bias,
    trained_block_reason="its Markov bias and confidence were trained on the trained block's positions only",
    # vLLM: model runner V2 only, method "dspark" (config/speculative.py:882-887); SGLang drafts another block
    # layout (module docstring)
    served_by={"vllm": "0.26"}, vllm_method="dspark",
)
