"""Untrusted files: only safetensors are read, remote code stays off unless asked, and a drafter directory
whose config.json disagrees with its tensors fails at load naming the tensor and the field."""

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter, save_drafter
from dflashkit.errors import UserError

from support.paths import ROOT

PACKAGES = ["drafter", "extract", "train", "eval", "dflashkit"]
TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=100)


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            yield node, (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")), f


def test_no_unpickling_anywhere_in_the_package():
    """No pickle/torch.load/np.load(allow_pickle) in the sources; remote code only when the user passes it."""
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                    if any(n.split(".")[0] in ("pickle", "dill", "cloudpickle", "joblib") for n in names):
                        offenders.append(f"{path}:{node.lineno} imports a pickle module")
            for node, name, f in _calls(tree):
                base = getattr(getattr(f, "value", None), "id", "")
                if name == "load" and base == "torch":
                    offenders.append(f"{path}:{node.lineno} torch.load")
                if name == "load" and base in ("np", "numpy") and any(
                        k.arg == "allow_pickle" for k in node.keywords):
                    offenders.append(f"{path}:{node.lineno} np.load(allow_pickle)")
                for k in node.keywords:  # trust_remote_code must come from the user, never a literal True
                    if k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value:
                        offenders.append(f"{path}:{node.lineno} trust_remote_code=True")
    assert offenders == []


def _export(tmp_path) -> Path:
    cfg = DrafterConfig.for_target(TARGET, num_hidden_layers=2, block_size=4, mask_token_id=99)
    return save_drafter(build_drafter(cfg), tmp_path / "d")


def test_config_that_disagrees_with_tensor_shapes_fails_at_load(tmp_path):
    d = _export(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 64  # the tensors were made for 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*intermediate_size"):
        load_drafter(d)


def test_taps_that_disagree_with_fc_fail_at_load(tmp_path):
    d = _export(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 2, 3]  # fc was made for two taps
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"fc\.weight.*target_layer_ids"):
        load_drafter(d)


def test_missing_and_extra_tensors_fail_at_load(tmp_path):
    d = _export(tmp_path)
    state = load_file(str(d / "model.safetensors"))
    state.pop("layers.1.mlp.up_proj.weight")
    state["layers.7.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers\.1\.mlp\.up_proj\.weight'\].*unexpected"):
        load_drafter(d)


def test_pickled_weights_are_refused_not_loaded(tmp_path):
    d = _export(tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(UserError, match="pickle files are never loaded"):
        load_drafter(d)


def test_mask_token_outside_vocabulary_is_rejected_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="mask_token_id 100 is outside the target's vocabulary"):
        DrafterConfig.for_target(TARGET, num_hidden_layers=2, mask_token_id=100)
    d = _export(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 5000
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: mask_token_id 5000"):
        load_drafter(d)
