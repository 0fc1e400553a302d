"""`dflashkit init-drafter`: the road of training (recipe + overrides -> TrainConfig -> the trainer's model
builder) to a loadable export with the conventions of docs/ARCHITECTURE.md."""

import json

import torch

from dflashkit.cli import main as cli
from dflashkit.drafter import load_drafter

from support.paths import TINY_RECIPE
from support.tiny_targets import make_tiny_target


def test_init_drafter_for_testbed(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli(["init-drafter", "--target", "testbed:smollm2", "--out", str(out), "--num-layers", "2",
                "--block-size", "8", "--mask-token-id", "16", "--dtype", "float32"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    # SmolLM2-135M: 30 layers, hidden 576, vocab 49152; two taps evenly spaced from 1 to L-3
    assert cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152 and cfg["num_target_layers"] == 30
    assert cfg["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 27], "block_size": 8}
    model = load_drafter(out)
    assert model.fc.weight.shape == (576, 2 * 576)
    y = model(position_ids=torch.arange(13)[None], noise_embedding=torch.randn(1, 8, 576),
              target_hidden=torch.randn(1, 5, 2 * 576))
    assert y.shape == (1, 8, 576) and torch.isfinite(y).all()


def test_init_drafter_takes_a_recipe_and_overrides(tmp_path):
    target = make_tiny_target(tmp_path / "target")
    out = tmp_path / "d"
    assert cli(["init-drafter", "--target", str(target), "--out", str(out), "--recipe", str(TINY_RECIPE),
                "--layer-types", "sliding,full", "--sliding-window", "8", "target_layer_ids=[0,2]", "seed=3"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    # recipes/tiny.yaml: 2 layers, block 4, mask 95, intermediate 64; the flags and key=value on top
    assert (cfg["num_hidden_layers"], cfg["block_size"], cfg["intermediate_size"]) == (2, 4, 64)
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [0, 2], "block_size": 4}
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 8
    # the seed decides the weights: the same seed gives the same drafter, another seed another one
    again = tmp_path / "again"
    assert cli(["init-drafter", "--target", str(target), "--out", str(again), "--recipe", str(TINY_RECIPE),
                "--layer-types", "sliding,full", "--sliding-window", "8", "target_layer_ids=[0,2]", "seed=3"]) == 0
    other = tmp_path / "other"
    assert cli(["init-drafter", "--target", str(target), "--out", str(other), "--recipe", str(TINY_RECIPE),
                "--layer-types", "sliding,full", "--sliding-window", "8", "target_layer_ids=[0,2]", "seed=4"]) == 0
    a, b, c = (load_drafter(d).fc.weight for d in (out, again, other))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_init_drafter_errors_name_the_fix(tmp_path, capsys):
    # SmolLM2's tokenizer has no mask token and no spare embedding rows: the user must choose one
    assert cli(["init-drafter", "--target", "testbed:smollm2", "--out", str(tmp_path / "a")]) == 2
    assert "--mask-token-id" in capsys.readouterr().err
    assert cli(["init-drafter", "--target", "testbed:smollm2", "--out", str(tmp_path / "b"), "--mask-token-id",
                "16", "--target-layer-ids", "1", "30"]) == 2
    err = capsys.readouterr().err
    assert "[30]" in err and "0..29" in err
    assert cli(["init-drafter", "--target", "testbed:smollm2", "--out", str(tmp_path / "c"), "--mask-token-id",
                "49152"]) == 2
    assert "mask_token_id" in capsys.readouterr().err
    assert cli(["init-drafter", "--target", "testbed:smollm2", "--out", str(tmp_path / "d"), "--mask-token-id",
                "16", "--num-layers", "3", "--layer-types", "full,sliding"]) == 2
    assert "--layer-types has 2 entries for 3 drafter layers" in capsys.readouterr().err
    assert cli(["init-drafter", "--target", "testbed:smollm2", "--out", str(tmp_path / "e"), "lr=fast"]) == 2
    assert "lr: 'fast' is not a float" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "abcde")
