"""The DFlash drafter: config, model, and save/load in the reference export format.

Imports nothing else of dflashkit but the dependency-free ``dflashkit.errors`` / ``dflashkit.untrusted`` (train/
and eval/ build on it).
"""

from .config import DrafterConfig, check_target_layer_ids, default_target_layer_ids
from .export import build_drafter, load_drafter, read_drafter_config, save_drafter
from .kinds import KINDS, DrafterKind, drafter_kind, kind_for
from .modeling_dflash import DFlashDraftModel
from .modeling_dflash2 import CandidateSelector, DFlash2DraftModel, GroupedDynamicCausalConv
from .modeling_dspark import DSparkDraftModel

__all__ = ["KINDS", "CandidateSelector", "DrafterConfig", "DrafterKind", "DFlash2DraftModel", "DFlashDraftModel",
           "DSparkDraftModel", "GroupedDynamicCausalConv", "build_drafter", "check_target_layer_ids",
           "default_target_layer_ids", "drafter_kind", "kind_for", "load_drafter", "read_drafter_config",
           "save_drafter"]
