"""DFlash: the block drafter of the DFlash paper (drafter/modeling_dflash.py). It proposes each draft position's
argmax, trains on the block loss alone, decodes chains or trees of any block size, and has no config fields of
its own."""

from __future__ import annotations

from ..modeling_dflash import DFlashDraftModel
from .kind import DrafterKind, argmax_proposal

DFLASH = DrafterKind(
    architecture="dflash", name="DFlash", class_name="DFlashDraftModel", model_class=DFlashDraftModel,
    modeling_files=("modeling_dflash.py",), propose=argmax_proposal,
    # the oldest vLLM release whose rules drafter/vllm_rules.py holds (VLLM_RULES); SGLang's are read from its DFlash
    # sources, no release pinned
    served_by={"vllm": "0.24", "sglang": "unpinned"},
)
