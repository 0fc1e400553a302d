"""The drafter kinds (drafter/kinds/): one entry per DrafterConfig.architecture, looked up by name. DFlash and
DFlash2 are built and propose through it; an architecture without an entry, or a model without its config, is
refused; no product module outside drafter/kinds/ asks which architecture or whether a kind has a selector."""

import ast

import pytest
import torch
from torch import nn

from dflashkit.drafter import KINDS, DFlash2DraftModel, DFlashDraftModel, DrafterConfig, build_drafter
from dflashkit.drafter.kinds import argmax_proposal, drafter_kind, kind_for
from dflashkit.drafter.kinds.dflash2 import SelectorOptions, selector_proposal

from support.paths import ROOT

SIZES = dict(hidden_size=32, num_target_layers=4, vocab_size=64, num_hidden_layers=1, num_attention_heads=4,
             mask_token_id=63, block_size=4)
DFLASH2 = dict(architecture="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


class Wrapper(nn.Module):
    """What DDP and DeepSpeed hand the trainer: the drafter as ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_every_architecture_has_its_kind():
    assert set(KINDS) == {"dflash", "dflash2", "dspark"}
    assert all(kind.architecture == name for name, kind in KINDS.items())
    assert len({kind.class_name for kind in KINDS.values()}) == len(KINDS)
    assert all(kind.auto_map.endswith(f".{kind.model_class.__name__}") for kind in KINDS.values())


def test_each_kinds_own_fields_are_drafter_config_fields_at_its_defaults():
    """A kind's config_fields become keyword-only DrafterConfig fields at the kind's defaults (KindFields), and
    DFlash2's are the four its modeling file and vLLM 0.28 read."""
    import dataclasses

    from dflashkit.drafter import modeling_dflash2
    from dflashkit.drafter.vllm_dflash2 import VLLM_028_DFLASH2_FIELDS

    fields = {f.name: f for f in dataclasses.fields(DrafterConfig)}
    for kind in KINDS.values():
        for name, default in kind.config_fields.items():
            assert fields[name].kw_only and fields[name].default == default, name
    assert tuple(KINDS["dflash2"].config_fields) == modeling_dflash2.DFLASH2_FIELDS == VLLM_028_DFLASH2_FIELDS
    assert DrafterConfig(**SIZES).selector_rank == 256 and DrafterConfig(**SIZES, **DFLASH2).selector_rank == 8


def test_dflash_and_dflash2_dispatch_through_the_kinds():
    torch.manual_seed(0)
    dflash, dflash2 = build_drafter(DrafterConfig(**SIZES)), build_drafter(DrafterConfig(**SIZES, **DFLASH2))
    assert type(dflash) is DFlashDraftModel and type(dflash2) is DFlash2DraftModel
    assert drafter_kind(dflash).propose is argmax_proposal and drafter_kind(dflash).selector_of(dflash) is None
    kind = drafter_kind(Wrapper(dflash2))  # read through a wrapper too
    assert kind.propose is selector_proposal and kind.selector_of(Wrapper(dflash2)) is dflash2.candidate_selector
    hidden, anchor = torch.randn(2, 3, 32), torch.tensor([5, 9])
    logits = torch.randn(2, 3, 64)
    assert torch.equal(drafter_kind(dflash).propose(dflash, hidden, logits, anchor), logits.argmax(-1))
    path, _, _ = dflash2.candidate_selector.select(hidden, logits, anchor)
    assert torch.equal(kind.propose(dflash2, hidden, logits, anchor), path)


def test_an_architecture_without_a_kind_is_refused():
    with pytest.raises(ValueError, match=r"no drafter kind is registered for architecture='medusa'.*'dflash2'"):
        kind_for("medusa")
    model = build_drafter(DrafterConfig(**SIZES))
    model.dflash.architecture = "medusa"  # a config that bypassed its own check
    with pytest.raises(ValueError, match="medusa"):
        drafter_kind(model)
    del model.dflash
    with pytest.raises(TypeError, match="carries no DrafterConfig"):
        drafter_kind(model)


def test_the_kinds_capabilities_answer_for_them():
    """What eval/ and the engines' rules ask a kind: DFlash decodes trees and longer blocks, DFlash2 neither (one
    line naming the fix each), and its served_by names the releases whose rules drafter/ checks."""
    from dflashkit.drafter import vllm_rules
    from dflashkit.drafter.vllm_dflash2 import VLLM_DFLASH2_VERSION
    from dflashkit.errors import UserError

    dflash, dflash2 = KINDS["dflash"], KINDS["dflash2"]
    dflash.check_decoding("tree", 32, 16)
    dflash2.check_decoding("chain", 16, 16)
    with pytest.raises(UserError, match="decode DFlash2 drafters with --mode chain"):
        dflash2.check_decoding("tree", 16, 16)
    with pytest.raises(UserError, match=r"block_size 17 > the DFlash2 drafter's block_size 16: .*<= 16"):
        dflash2.check_decoding("chain", 17, 16)
    assert (dflash.proposes_argmax, dflash2.proposes_argmax) == (True, False)
    assert (dflash.whole_block_only, dflash2.whole_block_only) == (False, True)
    assert dflash.served_by["vllm"] == min(vllm_rules.VLLM_RULES)
    assert dflash2.served_by["vllm"] == VLLM_DFLASH2_VERSION
    assert dflash.options_from(None) is None and dflash2.default_options() == SelectorOptions()
    assert SelectorOptions(unary_grad=True, hidden_grad=False, missing_label="inject", kernel=True).evaluation() \
        == SelectorOptions(kernel=True)


# ------------------------------------------------------------------ no kind knowledge outside drafter/kinds/
PRODUCT_FOLDERS = ("dflashkit", "drafter", "targets", "extract", "train", "eval")  # pyproject's package-dir


def kind_tests(source: str, names) -> list[str]:
    """Where ``source`` asks which kind it holds: a comparison of a kind's architecture name (a string equal to
    one of ``names``) with anything naming an architecture, or a kind's ``selector`` read to learn whether it has
    one (``drafter_kind(m).selector``, ``kind.selector``); one "line: code" each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Constant) and s.value in names for s in sides)
            if named and any("architecture" in ast.unparse(s) for s in sides):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "selector":
            owner = ast.unparse(node.value)
            if owner.split(".")[-1].endswith("kind") or owner.startswith(("drafter_kind(", "kind_for(")):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_finds_each_form_of_kind_test():
    source = ("if cfg.drafter_architecture != 'dflash2': pass\n"
              "x = 'dflash2' == config.architecture\n"
              "y = drafter_kind(model).selector is not None\n"
              "z = self.kind.selector\n"
              "ok = spec.get('method') == 'dflash' and kind.propose and a.architecture == b.architecture\n")
    assert sorted(hit.split(":")[0] for hit in kind_tests(source, set(KINDS))) == ["1", "2", "3", "4"]


def test_no_architecture_name_is_compared_outside_the_kinds():
    """Every question about a kind goes to drafter/kinds/: no product module outside it compares an architecture
    name (``architecture == "dflash2"``) or asks whether a kind has a selector; a new kind is then one kind file
    (plus its modeling file), with nothing to find and change elsewhere."""
    found = {}
    for folder in PRODUCT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "drafter" / "kinds"):
                continue
            hits = kind_tests(path.read_text(), set(KINDS))
            if hits:
                found[str(path.relative_to(ROOT))] = hits
    assert not found, f"ask the kind (drafter/kinds/) instead: {found}"
