"""The drafter kinds: one entry per ``DrafterConfig.architecture``, the one place that says how DFlash and DFlash2
differ on the model side.

Design choices:
- One dict keyed by architecture (``KINDS``), no decorators or discovery (docs/ARCHITECTURE.md): a new kind is a
  new entry here, plus its training term in train/drafter_pass.py's ``EXTRA_LOSS_TERMS``, keyed the same way.
- A kind owns its model class (what ``build_drafter`` builds) and its proposal: DFlash proposes the argmax of each
  draft position's logits; DFlash2 the path of its candidate selector (``CandidateSelector.select``, the
  reference's rule), whose module ``selector_of`` hands to the sampled path of eval/ and to the trainer.
- A kind names the modeling files an export ships (``modeling_files``; DFlash2's imports DFlash's, so both ship)
  and the module config.json's ``auto_map`` points at (``modeling_module``): drafter/config.py and
  drafter/export.py ask the kind, never the architecture's name.
- A model's kind is read from the DrafterConfig it carries (``model.dflash``, set by ``build_drafter`` and so by
  ``load_drafter``), through a DDP / DeepSpeed wrapper's ``.module``; nobody asks a model which attributes it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .config import MODELING_FILES, DrafterConfig
from .modeling_dflash import DFlashDraftModel
from .modeling_dflash2 import DFlash2DraftModel


def argmax_proposal(drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                    anchor_ids: torch.Tensor) -> torch.Tensor:
    """DFlash: each draft position's most likely token; logits [b, P, V] -> tokens [b, P]."""
    return logits.argmax(dim=-1)


def selector_proposal(drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                      anchor_ids: torch.Tensor) -> torch.Tensor:
    """DFlash2: the candidate selector's greedy path over the draft positions, given the block's anchor ids [b];
    hidden [b, P, H] (the final states of positions 1..P), logits [b, P, V] -> tokens [b, P]."""
    tokens, _, _ = drafter.candidate_selector.select(hidden, logits, anchor_ids)
    return tokens


@dataclass(frozen=True)
class DrafterKind:
    architecture: str  # DrafterConfig.architecture, the key of KINDS
    model_class: type[DFlashDraftModel]  # what build_drafter builds for it
    # the greedy proposal of one block: (drafter, hidden [b, P, H], logits [b, P, V], anchor_ids [b]) -> [b, P]
    propose: Callable[..., torch.Tensor]
    selector: str | None = None  # attribute name of the candidate selector module (DFlash2); None: no selector
    # the modeling files (beside this one in drafter/) an export ships; the last defines model_class
    modeling_files: tuple[str, ...] = ("modeling_dflash.py",)

    @property
    def modeling_module(self) -> str:
        """The module of config.json's ``auto_map``: the shipped modeling file that defines ``model_class``."""
        return self.modeling_files[-1].removesuffix(".py")

    def selector_of(self, model: nn.Module) -> nn.Module | None:
        """The model's candidate selector module (None for a kind without one)."""
        return None if self.selector is None else getattr(_unwrapped(model), self.selector)


KINDS = {
    "dflash": DrafterKind("dflash", DFlashDraftModel, argmax_proposal, modeling_files=MODELING_FILES["dflash"]),
    "dflash2": DrafterKind("dflash2", DFlash2DraftModel, selector_proposal, selector="candidate_selector",
                           modeling_files=MODELING_FILES["dflash2"]),
}


def kind_for(architecture: str) -> DrafterKind:
    """The kind registered for ``architecture``; ValueError naming the known ones for any other."""
    if architecture not in KINDS:
        raise ValueError(f"no drafter kind is registered for architecture={architecture!r}; the kinds are "
                         f"{sorted(KINDS)} (drafter/kinds.py)")
    return KINDS[architecture]


def drafter_kind(model: nn.Module) -> DrafterKind:
    """The kind of a built drafter (also wrapped by DDP or DeepSpeed), read from the DrafterConfig it carries."""
    config = getattr(_unwrapped(model), "dflash", None)
    if not isinstance(config, DrafterConfig):
        raise TypeError(f"{type(model).__name__} carries no DrafterConfig (.dflash); build drafters with "
                        f"dflashkit.drafter.build_drafter or load_drafter")
    return kind_for(config.architecture)


def _unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP, DeepSpeed and FSDP1 wrappers hold the drafter as .module
