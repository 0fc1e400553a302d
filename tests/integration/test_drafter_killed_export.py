"""An export SIGKILLed in a fresh process, at each of its two pause points (its full copy written; between its two
renames), leaves siblings whose names fit the file system; loading names what happened, and the next export
recovers and cleans them (the in-process cases: tests/unit/drafter/test_drafter_directory.py)."""

import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from dflashkit.drafter import load_drafter, save_drafter
from dflashkit.errors import UserError

from support.processes import run_until_paused
from support.tiny_targets import SMALL_TARGET_DIMS, small_drafter, small_export

TARGET = LlamaConfig(**SMALL_TARGET_DIMS)
_model, _export = small_drafter, small_export


def _same_weights(model, d: Path) -> bool:
    saved = load_file(str(d / "model.safetensors"))
    return all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


KILLED_EXPORT = textwrap.dedent("""
    import sys, torch
    from transformers import LlamaConfig
    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
    target = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=100)
    torch.manual_seed(1)
    save_drafter(build_drafter(DrafterConfig.for_target(target, num_hidden_layers=2, block_size=4,
                                                        mask_token_id=99)), sys.argv[1])
""")


@pytest.mark.parametrize("point", ["export-copy-written", "export-between-renames"])
def test_what_a_sigkilled_export_leaves_is_recognised_and_cleaned(tmp_path, capsys, point):
    name = "x" * 245  # long enough that every sibling name is shortened
    d = _export(tmp_path / name, seed=0)
    proc = run_until_paused([sys.executable, "-c", KILLED_EXPORT, str(d)], point, tmp_path / "paused")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    (tmp_path / "paused").unlink()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != name)  # the copy (and the moved-aside d)
    assert len(leftovers) == (2 if point == "export-between-renames" else 1)
    assert all(n.startswith(".xxxxxxxx") and len(n) <= 255 for n in leftovers), leftovers
    if point == "export-between-renames":
        with pytest.raises(UserError, match="an export to it was interrupted"):
            load_drafter(d)
    else:
        assert _same_weights(_model(seed=0), d)
    save_drafter(_model(seed=2), d)
    assert _same_weights(_model(seed=2), d) and sorted(p.name for p in tmp_path.iterdir()) == [name]
    err = capsys.readouterr().err
    assert all(n in err for n in leftovers) and "left by an interrupted export" in err
