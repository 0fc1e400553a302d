"""Manifests and drafter indexes are untrusted input: every file they name stays inside its directory (no `..`, no
absolute path, no symlink out, regular files only), sizes are compared before hashing, and a malformed manifest is
one line naming the file and the field. The cases that could hang a command (a device named as a shard) run it in
a fresh process with a timeout: tests/integration/test_untrusted_shard_devices.py.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from dflashkit.cli import main as cli
from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter, save_drafter
from dflashkit.extract.shards.manifest import read_manifest
from dflashkit.extract.shards.reader import ShardDataset
from dflashkit.extract.shards.verify import verify_dataset
from dflashkit.files import sha256_file

from support.manifests import copy_shards, edit_manifest, one_error_line, train_argv


# ----------------------------------------------------------------------------- shard names outside the directory
def test_dot_dot_and_absolute_names_are_refused(tiny_run, tmp_path):
    shards = copy_shards(tiny_run, tmp_path)
    first = read_manifest(shards)["shards"][0]
    outside = tmp_path / "elsewhere" / "copy.safetensors"  # a real shard, sha256 and size matching the manifest
    outside.parent.mkdir()
    shutil.copy(shards / first["file"], outside)
    assert sha256_file(outside) == first["sha256"]
    for name in ["../../../../etc/passwd", f"../elsewhere/{outside.name}", str(outside)]:
        edit_manifest(shards, lambda m, name=name: m["shards"][0].update(file=name))
        errors, _ = verify_dataset(shards)
        assert any(f"shards[0].file is {name!r}" in e and "no '..', no absolute path" in e for e in errors), errors
        with pytest.raises(ValueError, match=r"manifest.json: shards\[0\]\.file is .*relative name inside"):
            ShardDataset(shards)


def test_a_symlink_out_of_the_directory_is_refused_one_inside_is_read(tiny_run, tmp_path):
    shards = copy_shards(tiny_run, tmp_path)
    first = read_manifest(shards)["shards"][0]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shards / first["file"], outside)
    os.symlink(outside, shards / first["file"])  # same name, same bytes, but the file lies elsewhere
    errors, _ = verify_dataset(shards)
    assert any("resolves to" in e and "outside" in e and "shards[0].file" in e for e in errors), errors
    with pytest.raises(ValueError, match="outside"):
        ShardDataset(shards)
    (shards / first["file"]).unlink()
    shutil.move(outside, shards / "kept.bin")
    os.symlink("kept.bin", shards / first["file"])  # a link that stays inside the directory is fine
    assert verify_dataset(shards)[0] == []
    assert len(ShardDataset(shards)) == 12


def test_a_shard_whose_size_differs_is_refused_before_hashing(tiny_run, tmp_path):
    shards = copy_shards(tiny_run, tmp_path)
    m = edit_manifest(shards, lambda m: m["shards"][1].update(bytes=m["shards"][1]["bytes"] + 8))
    errors, _ = verify_dataset(shards)
    assert errors == [f"{shards / m['shards'][1]['file']}: size {m['shards'][1]['bytes'] - 8} bytes, the manifest "
                      f"says {m['shards'][1]['bytes']} (truncated or replaced)"]
    with pytest.raises(ValueError, match="truncated or replaced"):
        ShardDataset(shards)


# ----------------------------------------------------------------------------- malformed manifests: one line
@pytest.mark.parametrize("change,field", [
    (lambda m: [m], "the top level is a list, a manifest is an object"),
    (lambda m: m["shards"][0].pop("sha256"), r"shards[0].sha256 is missing"),
    (lambda m: m["shards"][1].update(samples="4"), r"shards[1].samples is a string ('4'), expected a number"),
    (lambda m: m["shards"][0].update(sha256="00"), r"shards[0].sha256 is '00', expected 64 hex digits"),
    (lambda m: m.update(shards={"a": 1}), "field shards is an object"),
    (lambda m: m.update(target_layer_ids=[0, "2"]), "target_layer_ids[1] is a string"),
    (lambda m: m["shards"].__setitem__(0, 7), "shards[0] is a number ('7'), expected an object"),
])
def test_a_malformed_manifest_is_one_line_naming_the_file_and_field(tiny_run, tmp_path, capsys, change, field):
    shards = copy_shards(tiny_run, tmp_path)
    edit_manifest(shards, change)
    with pytest.raises(ValueError) as error:
        ShardDataset(shards)
    assert str(error.value).startswith(f"{shards / 'manifest.json'}: ") and field in str(error.value)
    assert "\n" not in str(error.value)
    assert verify_dataset(shards)[0] == [str(error.value)]
    assert cli(train_argv(shards, tmp_path / "run")) == 2
    line = one_error_line(capsys.readouterr().err, "dflashkit train")
    assert field in line and str(shards / "manifest.json") in line


def test_verify_checks_the_layer_ids_against_the_target(tiny_run, tmp_path):
    """The manifest's own num_target_layers, and the target's config.json when the target is on this machine."""
    shards = copy_shards(tiny_run, tmp_path)
    edit_manifest(shards, lambda m: m.update(target_layer_ids=[0, 9]))
    errors, _ = verify_dataset(shards)
    assert any("target_layer_ids [0, 9] lie outside the 4 decoder layers of its num_target_layers" in e
               for e in errors), errors
    edit_manifest(shards, lambda m: m.update(num_target_layers=12))  # a manifest that agrees with itself
    errors, _ = verify_dataset(shards)
    assert any("outside the 4 decoder layers of its target's config.json" in e for e in errors), errors
    assert not any("num_target_layers" in e for e in errors)


# ----------------------------------------------------------------------------- drafter index
def _drafter(path: Path) -> Path:
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=100)
    return save_drafter(build_drafter(DrafterConfig.for_target(target, num_hidden_layers=1, block_size=4,
                                                               mask_token_id=99)), path)


def _index(directory: Path, file_name: str, names_from: Path | None = None) -> None:
    """An index.json mapping every tensor (of ``names_from``, default the directory's weights) to ``file_name``."""
    from safetensors import safe_open

    with safe_open(str(names_from or directory / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: file_name for n in names}}))


def test_a_drafter_index_may_not_name_files_outside_the_directory(tmp_path):
    other = _drafter(tmp_path / "other")
    mine = _drafter(tmp_path / "mine")
    _index(mine, "../other/model.safetensors")
    (mine / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: weight_map\['.*'\] is "
                                         r"'\.\./other/model\.safetensors'.*no '\.\.'"):
        load_drafter(mine)
    _index(mine, str(other / "model.safetensors"), names_from=other / "model.safetensors")
    with pytest.raises(ValueError, match="no absolute path"):
        load_drafter(mine)
    os.symlink(other / "model.safetensors", mine / "model.safetensors")
    _index(mine, "model.safetensors")  # a plain name, but a link to another directory
    with pytest.raises(ValueError, match="outside"):
        load_drafter(mine)


def test_a_drafter_index_that_is_not_json_names_the_file(tmp_path):
    d = _drafter(tmp_path / "d")
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"d/model\.safetensors\.index\.json: not valid JSON"):
        load_drafter(d)
    (d / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match=r"index\.json: field weight_map is missing"):
        load_drafter(d)


def test_a_hub_snapshot_with_links_into_its_blobs_loads(tmp_path):
    """The Hugging Face cache layout: snapshots/REV/* are links to ../../blobs/HASH (allowed), nothing else."""
    src = _drafter(tmp_path / "src")
    repo = tmp_path / "models--org--drafter"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for k, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{k}")
        os.symlink(f"../../blobs/blob{k}", snapshot / f.name)
    _index(snapshot, "model.safetensors")
    model = load_drafter(snapshot)
    assert model.dflash.block_size == 4
