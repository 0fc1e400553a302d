"""DFlash2: DFlash plus in-block dynamic convolutions and a candidate selector (drafter/modeling_dflash2.py).

- Config: four whole-number fields of its own (``CONFIG_FIELDS``), written under ``dflash_config`` by name and
  required when config.json names DFlash2DraftModel. Defaults: what the published DFlash2 drafters and trainers
  use (z-lab's DFlash2 drafter configs, NeMo Automodel examples/speculative/dflash/qwen3_dflash2.yaml:
  conv_kernel_size 2, conv_group_size 16, selector_rank 256, selector_top_k 16).
- Proposal: the path of its candidate selector (``CandidateSelector.select``, the reference's rule), not the
  argmax; sampled decoding uses the selector module too (``selector``).
- Loss: the selector's term beside the block loss (train/drafter_pass.py, ``EXTRA_LOSS_TERMS["candidate_selector"]``;
  train/selector_loss.py), with one options object, ``SelectorOptions``, built from a run's ``selector_*`` settings.
- Capabilities: the selector scores each position given the token chosen before it, so it decodes chains only; its
  convolutions span one trained block, so it drafts no longer block than trained; vLLM 0.28 serves it with
  num_speculative_tokens = block_size - 1 and no schedule (drafter/vllm_dflash2.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dflashkit.errors import UserError

from ..modeling_dflash2 import DFlash2DraftModel
from .kind import DrafterKind

# the kind's DrafterConfig fields -> default
CONFIG_FIELDS = {
    "conv_kernel_size": 2,  # taps of the in-block causal convolution (self + K-1 before)
    "conv_group_size": 16,  # channels sharing one dynamic tap; must divide hidden_size
    "selector_rank": 256,  # width of the selector's token codebooks and hidden projection
    "selector_top_k": 16,  # candidates per draft position the selector chooses among
}


def check_fields(config) -> None:
    """The bounds of the kind's fields in a DrafterConfig; UserError naming the field and the fix."""
    if int(config.conv_kernel_size) < 1 or int(config.selector_rank) < 1:
        raise UserError(f"conv_kernel_size={config.conv_kernel_size} and selector_rank={config.selector_rank} "
                        f"must be >= 1")
    if int(config.conv_group_size) < 1 or config.hidden_size % int(config.conv_group_size):
        raise UserError(f"conv_group_size={config.conv_group_size} must divide hidden_size="
                        f"{config.hidden_size}; use a divisor such as 16")
    if not 1 <= int(config.selector_top_k) <= config.vocab_size:
        raise UserError(f"selector_top_k={config.selector_top_k} must be in 1..vocab_size={config.vocab_size}")


def selector_proposal(drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                      anchor_ids: torch.Tensor) -> torch.Tensor:
    """The candidate selector's greedy path over the draft positions, given the block's anchor ids [b];
    hidden [b, P, H] (the final states of positions 1..P), logits [b, P, V] -> tokens [b, P]."""
    tokens, _, _ = drafter.candidate_selector.select(hidden, logits, anchor_ids)
    return tokens


@dataclass(frozen=True)
class SelectorOptions:
    """How the selector's training term is computed (train/drafter_pass.py, train/selector_loss.py); each is the
    run setting ``selector_<name>`` (train/config.py says what each does)."""

    kernel: bool = False  # the pairwise term by train/selector_pair.py's kernels where they fit
    unary_grad: bool = False  # the unary logits carry a gradient to the drafter
    hidden_grad: bool = True  # False: the pairwise term's gradient stops at the selector's hidden projection
    weights: str = "decay"  # "loss": positions weighted and normalised as the block loss's
    missing_label: str = "skip"  # "inject", in training: a label outside the candidates takes the lowest one's slot

    @classmethod
    def from_settings(cls, settings) -> "SelectorOptions":
        """From a run's ``selector_*`` settings (a TrainConfig); None: the defaults."""
        if settings is None:
            return cls()
        return cls(kernel=bool(settings.selector_kernel), unary_grad=bool(settings.selector_unary_grad),
                   hidden_grad=bool(settings.selector_hidden_grad), weights=settings.selector_weights,
                   missing_label=settings.selector_missing_label)

    def evaluation(self) -> "SelectorOptions":
        """The options of held-out evaluation: the three that act only under a gradient left out (no gradient
        through the unary logits or withheld from the layers, no label injected), the others as trained."""
        return dataclasses.replace(self, unary_grad=False, hidden_grad=True, missing_label="skip")


DFLASH2 = DrafterKind(
    architecture="dflash2", name="DFlash2", class_name="DFlash2DraftModel", model_class=DFlash2DraftModel,
    modeling_files=("modeling_dflash.py", "modeling_dflash2.py"),  # DFlash2's imports DFlash's: both ship
    propose=selector_proposal, config_fields=CONFIG_FIELDS, check_fields=check_fields,
    loss_term="candidate_selector", loss_options=SelectorOptions.from_settings,
    selector="candidate_selector",
    chain_only_reason=("tree mode grows its tree from one distribution per draft position; a DFlash2 drafter's "
                       "candidate selector scores each position given the token chosen before it (one path), so "
                       "decode DFlash2 drafters with --mode chain"),
    trained_block_reason="its in-block convolutions span one trained block",
    whole_block_only=True,
    served_by={"vllm": "0.28"},  # drafter/vllm_dflash2.py: VLLM_DFLASH2_VERSION; SGLang's reader not verified
)
