"""The drafter kinds: one entry per ``DrafterConfig.architecture`` in ``KINDS``, and each kind's file the one place
that says what the kind is. Nothing outside this package compares an architecture's name
(tests/unit/drafter/test_drafter_kinds.py holds that); everything asks the kind.

Design choices:
- One dict keyed by architecture, no decorators or discovery (docs/ARCHITECTURE.md): the kinds are listed here.
- A model's kind is read from the DrafterConfig it carries (``model.dflash``, set by ``build_drafter`` and so by
  ``load_drafter``), through a DDP / DeepSpeed wrapper's ``.module``; nobody asks a model which attributes it has.
- drafter/ imports no train/ module, so a kind names its extra loss term (``loss_term``) and train/drafter_pass.py
  keeps the term's code under that name (``EXTRA_LOSS_TERMS``); the term's options are the kind's own object.

What a new kind provides (DSpark: a DFlash backbone plus its own heads):
1. ``drafter/modeling_<kind>.py``: the model class, a ``DFlashDraftModel`` subclass built from the Qwen3Config
   ``DrafterConfig.to_hf`` makes (its own fields under ``dflash_config``), that runs without dflashkit (it ships in
   exports; it may import modeling_dflash.py only). Its forward takes the keyword arguments its loss term's
   ``forward_inputs`` hands it and then returns (hidden, what the term's ``loss`` reads).
   config.json's ``architectures`` is its ``class_name``, ``auto_map`` its model class; fields an engine reads at
   the top level come from its ``json_fields``; the weights are the model's own state dict (drafter/export.py).
2. ``drafter/kinds/<kind>.py``: one ``DrafterKind`` (drafter/kinds/kind.py says each field): architecture, name,
   class_name (config.json ``architectures``), model_class, modeling_files (DFlash's first when it imports it),
   propose (or the argmax), config_fields (its own whole-number fields and defaults), loss_term and loss_options
   (a frozen options dataclass with ``evaluation()``, built from a run's settings), and its capabilities:
   chain_only_reason, trained_block_reason, whole_block_only, served_by.
3. Its entry in ``KINDS`` below; its config fields then become DrafterConfig fields (``KindFields``).
4. When it has an extra loss term, the term's code in train/ under its ``loss_term`` name
   (train/drafter_pass.py ``EXTRA_LOSS_TERMS``): drafter/ imports no train/ module. The term says its weight in
   a step, its normaliser, whether it replaces the block loss, and its metrics (train/drafter_pass.py
   ``ExtraLossTerm``); the step and the metric sums ask it.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .dflash import DFLASH
from .dflash2 import DFLASH2
from .dspark import DSPARK
from .kind import DrafterKind, argmax_proposal, unwrapped

KINDS: dict[str, DrafterKind] = {"dflash": DFLASH, "dflash2": DFLASH2, "dspark": DSPARK}
assert all(kind.architecture == name for name, kind in KINDS.items())

# Every kind's own fields as one dataclass that DrafterConfig derives from (drafter/config.py): keyword-only ints at
# their kind's defaults, so a kind declares its fields in its own file and nowhere else. Each means something only
# for its kind (its file comments it); DrafterConfig checks them by the kind (``check_fields``).
_OWN_FIELDS = [(name, kind) for kind in KINDS.values() for name in kind.config_fields]
assert len({name for name, _ in _OWN_FIELDS}) == len(_OWN_FIELDS), "two kinds declare a config field of one name"
KindFields = dataclasses.make_dataclass("KindFields", [
    (name, "int", dataclasses.field(default=kind.config_fields[name], kw_only=True)) for name, kind in _OWN_FIELDS])

__all__ = ["KINDS", "DrafterKind", "KindFields", "argmax_proposal", "by_class_name", "drafter_kind", "field_owner",
           "kind_for"]


def kind_for(architecture: str) -> DrafterKind:
    """The kind registered for ``architecture``; ValueError naming the known ones for any other."""
    if architecture not in KINDS:
        raise ValueError(f"no drafter kind is registered for architecture={architecture!r}; the kinds are "
                         f"{sorted(KINDS)} (drafter/kinds/)")
    return KINDS[architecture]


def by_class_name(class_name: str) -> DrafterKind | None:
    """The kind whose config.json ``architectures`` name is ``class_name`` (None for none)."""
    return next((kind for kind in KINDS.values() if kind.class_name == class_name), None)


def field_owner(name: str) -> DrafterKind | None:
    """The kind whose own config field ``name`` is (None for a field every kind has)."""
    return next((kind for kind in KINDS.values() if name in kind.config_fields), None)


def drafter_kind(model: nn.Module) -> DrafterKind:
    """The kind of a built drafter (also wrapped by DDP or DeepSpeed), read from the DrafterConfig it carries."""
    config = getattr(unwrapped(model), "dflash", None)
    if not isinstance(getattr(config, "architecture", None), str):
        raise TypeError(f"{type(model).__name__} carries no DrafterConfig (.dflash); build drafters with "
                        f"dflashkit.drafter.build_drafter or load_drafter")
    return kind_for(config.architecture)
