"""The config.json an export writes, held byte for byte: the DFlash and DFlash2 exports of fixed tiny configs hash
to the values recorded when the kinds moved into drafter/kinds/ (an intended change of the exported format updates
the hash here, in the same commit), each ships its kind's modeling files, and reads back to the config it came
from."""

import hashlib
import json

import pytest
import torch

from dflashkit.drafter import DrafterConfig, build_drafter, read_drafter_config, save_drafter

SIZES = dict(hidden_size=32, num_target_layers=6, vocab_size=64, num_hidden_layers=2, num_attention_heads=4,
             mask_token_id=63, block_size=4, target_layer_ids=[1, 3])
# case -> (the kind's settings, the files the export holds, sha256 of its config.json: first 16 hex digits)
CASES = {
    "dflash": ({}, ["config.json", "model.safetensors", "modeling_dflash.py"], "d6ea70aa128d5b86"),
    "dflash_causal_sliding": (dict(causal=True, layer_types=["sliding_attention", "full_attention"],
                                   sliding_window=8),
                              ["config.json", "model.safetensors", "modeling_dflash.py"], "d7f3e9f22e9dd36c"),
    "dflash2": (dict(architecture="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=8,
                     selector_top_k=5),
                ["config.json", "model.safetensors", "modeling_dflash.py", "modeling_dflash2.py"], "985398ba1a0d8da5"),
    "dflash2_defaults": (dict(architecture="dflash2", conv_group_size=16, selector_top_k=5),
                         ["config.json", "model.safetensors", "modeling_dflash.py", "modeling_dflash2.py"],
                         "756c37d302a7fc86"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_config_json_is_unchanged(tmp_path, case):
    settings, files, digest = CASES[case]
    torch.manual_seed(0)
    config = DrafterConfig(**SIZES, **settings)
    out = save_drafter(build_drafter(config), tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == files
    text = (out / "config.json").read_bytes()
    assert hashlib.sha256(text).hexdigest()[:16] == digest, json.loads(text)
    again = read_drafter_config(out)
    assert again.to_json_dict() == config.to_json_dict()
