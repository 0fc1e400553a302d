"""A drafter directory means one thing: its weights are model.safetensors (or the files its index names), each a
finite float stored once; its config.json is checked field by field; taps are listed in increasing order; an
export's temporary names fit the file system, and what a killed export leaves is recovered or named (an export
SIGKILLed in a fresh process: tests/integration/test_drafter_killed_export.py)."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from dflashkit.drafter import DrafterConfig, load_drafter, read_drafter_config, save_drafter
from dflashkit.drafter.config import check_target_layer_ids
from dflashkit.errors import UserError
from dflashkit.files import atomic_write

from support.tiny_targets import SMALL_TARGET_DIMS, small_drafter, small_export

TARGET = LlamaConfig(**SMALL_TARGET_DIMS)
_model, _export = small_drafter, small_export


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, ValueError), message  # cli.run_main: exit 2
    return message


def _edit_config(d: Path, edit) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg = edit(cfg) or cfg
    (d / "config.json").write_text(json.dumps(cfg))


def _same_weights(model, d: Path) -> bool:
    saved = load_file(str(d / "model.safetensors"))
    return all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


# ----------------------------------------------------------------------------- case 1: which files are weights
def test_a_stray_safetensors_file_beside_model_safetensors_is_never_loaded(tmp_path, capsys):
    d = _export(tmp_path / "d", seed=0)
    old = _export(tmp_path / "old", seed=1)
    os.rename(old / "model.safetensors", d / "old.safetensors")  # sorts after model.safetensors
    loaded = load_drafter(d)
    assert _same_weights(loaded, d)
    assert "ignored ['old.safetensors']" in capsys.readouterr().err


def test_weights_under_another_name_are_not_read(tmp_path):
    d = _export(tmp_path / "d")
    os.rename(d / "model.safetensors", d / "weights.safetensors")
    with pytest.raises(UserError, match=r"no model\.safetensors weights \(found \['weights\.safetensors'\]"):
        load_drafter(d)


def test_a_tensor_stored_in_two_indexed_files_is_an_error(tmp_path):
    d = _export(tmp_path / "d")
    state = load_file(str(d / "model.safetensors"))
    names = sorted(state)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({k: state[k] for k in first}, str(d / "part-1.safetensors"))
    save_file({k: state[k] for k in second + ["fc.weight"]}, str(d / "part-2.safetensors"))  # fc.weight twice
    (d / "model.safetensors").unlink()
    weight_map = {**{k: "part-1.safetensors" for k in first}, **{k: "part-2.safetensors" for k in second}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError) as error:
        load_drafter(d)
    assert "tensor fc.weight is stored twice (part-1.safetensors and part-2.safetensors)" in _one_line(error)


# ----------------------------------------------------------------------------- case 2: the weights themselves
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused_naming_the_tensor(tmp_path, value):
    d = _export(tmp_path / "d")
    state = load_file(str(d / "model.safetensors"))
    state["layers.1.mlp.up_proj.weight"][3, 2] = value
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(UserError) as error:
        load_drafter(d)
    assert "model.safetensors: tensor layers.1.mlp.up_proj.weight holds NaN or Inf" in _one_line(error)


def test_integer_weights_are_refused_naming_the_dtype(tmp_path):
    d = _export(tmp_path / "d")
    state = load_file(str(d / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"].to(torch.int8)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(UserError) as error:
        load_drafter(d)
    assert "model.safetensors: tensor fc.weight is int8; drafter weights are floats" in _one_line(error)


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_a_damaged_weight_file_is_one_line_saying_to_export_again(tmp_path, damage):
    d = _export(tmp_path / "d")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2] if damage == "cut" else b"not safetensors at all")
    with pytest.raises(UserError) as error:
        load_drafter(d)
    line = _one_line(error)
    assert f"{d / 'model.safetensors'}: not a readable safetensors file" in line and "export the drafter again" in line


def test_an_export_of_weights_that_are_not_finite_is_refused_and_the_old_export_kept(tmp_path):
    d = _export(tmp_path / "d", seed=0)
    before = (d / "model.safetensors").read_bytes()
    model = _model(seed=1)
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    with pytest.raises(UserError, match="tensor fc.weight holds NaN or Inf values"):
        save_drafter(model, d)
    assert (d / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


# ----------------------------------------------------------------------------- case 3: config.json fields
def _drop_mask(cfg):
    cfg.pop("mask_token_id")
    cfg["dflash_config"].pop("mask_token_id")


def _set(field, value):
    def edit(cfg):
        cfg.update({field: value})
    return edit


def _set_dflash(field, value):
    def edit(cfg):
        cfg["dflash_config"][field] = value
    return edit


@pytest.mark.parametrize("edit, said", [
    (lambda cfg: [cfg], "holds a JSON list, not an object of config fields"),
    (_set("dflash_config", "mask=99"), "dflash_config is 'mask=99'; it must be an object"),
    (_set_dflash("target_layer_ids", "1,3"), "dflash_config.target_layer_ids is '1,3'; it must be a list"),
    (_set("num_hidden_layers", "2"), "num_hidden_layers is '2'; it must be a whole number"),
    (_set_dflash("block_size", 4.7), "dflash_config.block_size is 4.7; it must be a whole number"),
    (_set_dflash("block_size", True), "dflash_config.block_size is True; it must be a whole number"),
    (_drop_mask, "no mask_token_id (dflash_config.mask_token_id)"),
    (_set_dflash("target_layer_ids", []), "dflash_config.target_layer_ids is empty"),
    (_set("architectures", ["LlamaForCausalLM"]), "architectures ['LlamaForCausalLM'] is not a DFlash drafter"),
])
def test_a_bad_config_field_is_one_line_naming_config_json_and_the_field(tmp_path, edit, said):
    d = _export(tmp_path / "d")
    _edit_config(d, edit)
    with pytest.raises(ValueError) as error:
        read_drafter_config(d)
    line = _one_line(error)
    assert line.startswith(f"{d / 'config.json'}") and said in line, line
    with pytest.raises(ValueError, match=re.escape(said)):
        load_drafter(d)


def test_a_whole_float_is_read_as_the_int_it_is(tmp_path):
    d = _export(tmp_path / "d")
    _edit_config(d, _set_dflash("block_size", 4.0))
    assert read_drafter_config(d).block_size == 4 and isinstance(read_drafter_config(d).block_size, int)


# ----------------------------------------------------------------------------- case 4: the order of the taps
def test_taps_out_of_layer_order_are_refused_everywhere_they_enter(tmp_path):
    with pytest.raises(UserError, match=r"target_layer_ids \[4, 1, 2\] are not in increasing order.*\[1, 2, 4\]"):
        DrafterConfig.for_target(TARGET, num_hidden_layers=2, target_layer_ids=[4, 1, 2], mask_token_id=99)
    with pytest.raises(UserError, match=r"\[20, 5, 9\] are not in increasing order"):
        check_target_layer_ids([20, 5, 9])  # without the target: before it is loaded
    d = _export(tmp_path / "d")
    _edit_config(d, _set_dflash("target_layer_ids", [3, 1]))
    with pytest.raises(UserError) as error:
        read_drafter_config(d)
    assert "dflash_config.target_layer_ids [3, 1] are not in increasing order" in _one_line(error)


# ----------------------------------------------------------------------------- case 5: export writing
@pytest.mark.parametrize("name", ["a" * 250, "é" * 127, "b" * 255])
def test_a_long_output_name_exports_and_exports_again(tmp_path, name):
    out = tmp_path / name
    save_drafter(_model(seed=0), out)
    save_drafter(_model(seed=1), out)  # replacing: the moved-aside sibling's name must fit too
    assert _same_weights(_model(seed=1), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_an_output_name_longer_than_the_file_system_allows_is_one_line(tmp_path):
    with pytest.raises(UserError) as error:
        save_drafter(_model(), tmp_path / ("c" * 256))
    assert "is 256 bytes, more than the 255 its file system allows" in _one_line(error)


def test_a_durable_file_with_a_long_name_is_written(tmp_path):
    path = tmp_path / ("s" * 253)  # ".NAME.tmp" would be 258 bytes
    atomic_write(path, b"shard")
    assert path.read_bytes() == b"shard" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def _leftover_copy(tmp_path: Path, name: str) -> Path:
    """A full export under the name of a killed export's temporary copy."""
    os.rename(_export(tmp_path / "scratch", seed=2), tmp_path / name)
    return tmp_path / name


def test_a_killed_exports_full_copy_is_removed_by_the_next_export(tmp_path, capsys):
    leftover = _leftover_copy(tmp_path, ".d.0123abcd")
    save_drafter(_model(), tmp_path / "d")
    assert not leftover.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert "removed ['.d.0123abcd'], left by an interrupted export to d" in capsys.readouterr().err


def test_an_export_moved_aside_by_a_killed_export_is_named_on_load_and_recovered(tmp_path, capsys):
    d = tmp_path / "d"
    previous = _export(tmp_path / "scratch", seed=0)
    (tmp_path / ".d.old-89abcdef").mkdir()
    os.rename(previous, tmp_path / ".d.old-89abcdef" / "d")  # killed between the two renames: no d
    with pytest.raises(UserError) as error:
        load_drafter(d)
    line = _one_line(error)
    assert f"{d} is missing: an export to it was interrupted" in line and ".d.old-89abcdef/d" in line
    with pytest.raises(UserError, match="an export to it was interrupted"):
        read_drafter_config(d)
    save_drafter(_model(seed=1), d)
    assert _same_weights(_model(seed=1), d) and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    err = capsys.readouterr().err
    assert f"{d}: moved back from .d.old-89abcdef" in err and "removed ['.d.old-89abcdef']" in err


def test_a_moved_aside_directory_that_is_not_an_export_goes_back_and_is_not_replaced(tmp_path):
    d = tmp_path / "d"
    (tmp_path / ".d.old-89abcdef" / "d").mkdir(parents=True)
    (tmp_path / ".d.old-89abcdef" / "d" / "notes.txt").write_text("mine")  # replaced by an older version, killed
    with pytest.raises(UserError, match="not a drafter directory.*removes only what it wrote"):
        save_drafter(_model(), d)
    assert (d / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_the_directories_of_a_running_export_are_left_alone(tmp_path):
    from dflashkit.drafter.export import _hold

    leftover = _leftover_copy(tmp_path, ".d.0123abcd")
    held = _hold(leftover)  # as a running export holds its temporary copy
    try:
        save_drafter(_model(), tmp_path / "d")
    finally:
        os.close(held)
    assert leftover.is_dir() and (tmp_path / "d" / "config.json").is_file()


def test_a_user_directory_that_only_looks_like_a_leftover_is_kept(tmp_path):
    mine = tmp_path / ".d.0123abcd"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    save_drafter(_model(), tmp_path / "d")
    assert (mine / "notes.txt").read_text() == "mine"
