"""vLLM 0.28's DFlash2 reader (drafter/vllm_dflash2.py VLLM_028_DFLASH2_RULES) against a DFlash2 export, train-free: a
tiny random drafter built and exported by dflashkit passes; each broken rule (a missing or misplaced field, a
wrong type, num_speculative_tokens other than block_size - 1, a missing, misshapen or unknown tensor, a per-batch-
size schedule) is one line naming the field or tensor. 0.28 needs torch 2.13, so its reader is not run here; with
DFLASHKIT_VLLM028_SOURCE set to an unpacked 0.28 wheel's vllm/ directory, the rules are also checked against it."""

import json
import os
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter, vllm_rules
from dflashkit.drafter import vllm_dflash2 as rules
from dflashkit.errors import UserError

TARGET = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=10, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=320, rope_theta=5e5)
BLOCK = 6
DFLASH2 = dict(architecture="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=12, selector_top_k=6)
SCHEDULE = [[1, 8, BLOCK - 1], [9, 64, 2]]


def _config(**kw) -> DrafterConfig:
    return DrafterConfig.for_target(TARGET, block_size=BLOCK, mask_token_id=319, num_hidden_layers=2,
                                    **{**DFLASH2, **kw})


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return save_drafter(build_drafter(_config()), tmp_path_factory.mktemp("dflash2") / "drafter")


@pytest.fixture
def drafter(exported, tmp_path) -> Path:
    """A fresh copy of the export for a test to break."""
    copy = tmp_path / "drafter"
    copy.mkdir()
    for f in exported.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def _edit_config(directory: Path, edit) -> None:
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def _edit_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _one_problem(directory: Path, **kw) -> str:
    problems = rules.vllm028_dflash2_problems(directory, **kw)
    assert len(problems) == 1, problems
    assert "\n" not in problems[0]
    return problems[0]


# --------------------------------------------------------------------------- the export passes
def test_a_dflash2_export_meets_every_rule_of_vllm_028(exported):
    assert rules.vllm028_dflash2_problems(exported) == []
    assert rules.vllm028_dflash2_problems(exported, num_speculative_tokens=BLOCK - 1) == []
    rules.check_vllm028_dflash2(exported, BLOCK - 1)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in rules.VLLM_028_DFLASH2_FIELDS} == {
        k: v for k, v in DFLASH2.items() if k != "architecture"}


def test_the_serve_command_of_a_dflash2_export_names_vllm_028_and_block_size_minus_one(exported):
    line = vllm_rules.vllm_serve_command("TARGET", str(exported), BLOCK)
    assert f'"num_speculative_tokens": {BLOCK - 1}' in line and line.endswith("# DFlash2: vLLM >= 0.28")
    assert "vLLM >= 0.28" not in vllm_rules.vllm_serve_command("TARGET", "not-a-directory", BLOCK)
    # a plan without the drafter (vLLM's n-gram) is served as it is: no DFlash2 rule applies to it
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert vllm_rules.vllm_serve_command("TARGET", str(exported), BLOCK, ngram).endswith(json.dumps(ngram) + "'")


def test_every_rule_cites_the_vllm_028_file():
    assert set(rules.VLLM_028_DFLASH2_RULES) == {"architecture", "conv_fields", "selector_fields", "neutral_fields",
                                                 "weights", "block_size", "schedule"}
    assert all(re.search(r"\.py:\d", where) for _, where in rules.VLLM_028_DFLASH2_RULES.values())


# --------------------------------------------------------------------------- config.json fields
@pytest.mark.parametrize("field", rules.VLLM_028_DFLASH2_FIELDS)
def test_a_missing_dflash2_field_is_one_line_naming_it(drafter, field):
    _edit_config(drafter, lambda c: c["dflash_config"].pop(field))
    assert f"dflash_config.{field} is missing" in _one_problem(drafter)


def test_a_dflash2_field_at_the_top_level_only_is_refused(drafter):
    def move(c):
        c["selector_top_k"] = c["dflash_config"].pop("selector_top_k")
    _edit_config(drafter, move)
    assert "dflash_config.selector_top_k is missing (it is read from dflash_config only" in _one_problem(drafter)


def test_a_dflash2_field_of_the_wrong_type_is_refused(drafter):
    _edit_config(drafter, lambda c: c["dflash_config"].update(conv_kernel_size="3"))
    assert "dflash_config.conv_kernel_size is '3'" in _one_problem(drafter)


def test_a_group_size_that_does_not_divide_hidden_size_is_refused(drafter):
    _edit_config(drafter, lambda c: c["dflash_config"].update(conv_group_size=24))
    assert "conv_group_size=24 does not divide hidden_size=64" in _one_problem(drafter)


def test_a_field_vllm_028_applies_but_training_did_not_is_refused(drafter):
    _edit_config(drafter, lambda c: c["dflash_config"].update(input_embedding_scale=8.0))
    assert "dflash_config.input_embedding_scale=8.0" in _one_problem(drafter)


def test_a_config_that_is_not_dflash2_is_one_line(drafter):
    _edit_config(drafter, lambda c: c.update(architectures=["DFlashDraftModel"]))
    assert "DFlash2DraftModel" in _one_problem(drafter)


# --------------------------------------------------------------------------- num_speculative_tokens = block_size - 1
def test_num_speculative_tokens_other_than_block_size_minus_one_is_refused(exported):
    line = _one_problem(exported, num_speculative_tokens=BLOCK - 3)
    assert line.startswith(f"num_speculative_tokens={BLOCK - 3}:") and f"--num-speculative-tokens {BLOCK - 1}" in line
    with pytest.raises(UserError, match=f"num_speculative_tokens={BLOCK - 3}: a DFlash2 drafter"):
        rules.check_vllm_num_speculative_tokens(_config(), BLOCK - 3)
    with pytest.raises(UserError, match="num_speculative_tokens=3"):
        vllm_rules.vllm_serve_command("TARGET", str(exported), BLOCK, {"method": "dflash", "model": str(exported),
                                                                  "num_speculative_tokens": 3})
    rules.check_vllm_num_speculative_tokens(_config(), BLOCK - 1)
    rules.check_vllm_num_speculative_tokens(_config(), None)
    rules.check_vllm_num_speculative_tokens(_config(architecture="dflash"), BLOCK - 3)  # DFlash: warned elsewhere


def test_a_config_without_block_size_is_refused(drafter):
    def drop(c):
        c.pop("block_size")
        c["dflash_config"].pop("block_size")
    _edit_config(drafter, drop)
    assert "dflash_config.block_size is missing" in _one_problem(drafter)


# --------------------------------------------------------------------------- weights
@pytest.mark.parametrize("name", ["layers.1.mlp_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight",
                                  "candidate_selector.successor_codebook", "fc.weight"])
def test_a_missing_weight_is_one_line_naming_it(drafter, name):
    _edit_weights(drafter, lambda t: t.pop(name))
    assert f"tensor {name} is missing" in _one_problem(drafter)


def test_a_weight_named_differently_is_refused_by_both_names(drafter):
    def rename(t):
        t["candidate_selector.successor_codebook.weight"] = t.pop("candidate_selector.successor_codebook")
    _edit_weights(drafter, rename)
    problems = rules.vllm028_dflash2_problems(drafter)
    assert len(problems) == 2
    assert "tensor candidate_selector.successor_codebook is missing" in problems[0]
    assert "tensor candidate_selector.successor_codebook.weight is not a DFlash2 parameter" in problems[1]


def test_a_weight_whose_shape_disagrees_with_config_is_refused(drafter):
    _edit_config(drafter, lambda c: c["dflash_config"].update(selector_rank=8))
    problems = rules.vllm028_dflash2_problems(drafter)
    assert {p.split(": tensor ")[1].split(" ")[0] for p in problems} == {
        "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight"}
    assert "has shape (320, 12) where vLLM 0.28 builds (320, 8)" in problems[0]


def test_a_damaged_weight_file_is_one_line(drafter):
    (drafter / "model.safetensors").write_bytes(b"\xff" * 16)
    assert "not a readable safetensors file" in _one_problem(drafter)


def test_check_raises_one_line_with_the_first_problem(drafter):
    _edit_weights(drafter, lambda t: t.pop("norm.weight"))
    with pytest.raises(UserError, match=r"not servable by vLLM 0\.28: .*tensor norm\.weight is missing") as info:
        rules.check_vllm028_dflash2(drafter)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- per-batch-size schedule
def test_a_schedule_is_refused_for_dflash2_and_passes_for_dflash(exported):
    with pytest.raises(UserError, match=r"num_speculative_tokens_per_batch_size \[\[1, 8, 5\], \[9, 64, 2\]\]: "
                                        r"refused for a DFlash2 drafter") as info:
        rules.check_vllm_schedule(_config(), SCHEDULE)
    assert f"num_speculative_tokens = block_size - 1 = {BLOCK - 1}" in str(info.value)
    spec = {"method": "dflash", "model": str(exported), "num_speculative_tokens": BLOCK - 1,
            rules.SCHEDULE_FIELD: SCHEDULE}
    with pytest.raises(UserError, match="refused for a DFlash2 drafter"):
        rules.check_vllm_schedule(_config(), spec)
    with pytest.raises(UserError, match="refused for a DFlash2 drafter"):
        vllm_rules.vllm_serve_command("TARGET", str(exported), BLOCK, spec)
    rules.check_vllm_schedule(_config(), None)
    rules.check_vllm_schedule(_config(architecture="dflash"), SCHEDULE)


# --------------------------------------------------------------------------- against the 0.28 source, when given
def test_the_rules_match_the_vllm_028_source_when_it_is_unpacked(exported):
    source = os.environ.get("DFLASHKIT_VLLM028_SOURCE")
    if not source:
        pytest.skip("set DFLASHKIT_VLLM028_SOURCE to an unpacked vLLM 0.28 wheel's vllm/ directory")
    root = Path(source)
    model = (root / "model_executor/models/qwen3_dflash2.py").read_text()
    speculator = (root / "v1/worker/gpu/spec_decode/dflash2/speculator.py").read_text()
    required = set(re.findall(r'draft_config\["(\w+)"\]', model + speculator))
    defaulted = set(re.findall(r'draft_config\.get\(\s*"(\w+)"', model))
    assert required == set(rules.VLLM_028_DFLASH2_FIELDS)
    assert defaulted == set(rules.VLLM_028_DFLASH2_NEUTRAL)
    assert "block_size=1 + speculative_config.num_speculative_tokens" in model
    # the parameters the DFlash2 modules add, by attribute name: each is a tensor name of the export
    added = set(re.findall(r"self\.(\w+) = (?:nn\.Parameter|ReplicatedLinear|DFlashGroupedConv)\(", model))
    assert added == {"base_kernel", "kernel_projection", "attention_conv", "mlp_conv", "predecessor_codebook",
                     "successor_codebook", "hidden_projection"}
    names = set(load_file(exported / "model.safetensors"))
    assert all(any(f".{a}." in f".{n}." for n in names) for a in added)
    assert '"DFlash2DraftModel": ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM")' in (
        root / "model_executor/models/registry.py").read_text()
    assert "self.candidate_selector = CandidateSelector(" in model
    # a schedule is accepted by 0.28 as is: no DFlash2 check guards it (dflashkit refuses it)
    assert "num_speculative_tokens_per_batch_size" not in model + speculator
