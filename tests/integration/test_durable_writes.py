"""Every durable write of the commands keeps dflashkit/files.py's one guarantee: the bytes are fsynced under a
temporary name, renamed into place, and the directory holding the new name is fsynced last (without that last
fsync a crash can lose the rename). Checked by what each writer fsyncs: a drafter export, a training checkpoint,
the online token cache and regenerate's merged output."""

from types import SimpleNamespace

import numpy as np
import torch
from transformers import LlamaConfig

from support.fsyncs import record_fsyncs

TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=100)


def test_a_drafter_export_is_fsynced_whole_and_its_rename_made_durable(tmp_path, monkeypatch):
    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter

    model = build_drafter(DrafterConfig.for_target(TARGET, num_hidden_layers=2, block_size=4, mask_token_id=99))
    save_drafter(model, tmp_path / "drafter")  # a first export, then one that replaces it
    log = record_fsyncs(monkeypatch)
    out = save_drafter(model, tmp_path / "drafter", overwrite=True)
    assert {"config.json", "model.safetensors", "modeling_dflash.py"} <= log.names()
    copy = [p for p in log.paths if p.name.startswith(".drafter.") and p.parent == tmp_path.resolve()]
    assert copy, "the temporary export directory itself is fsynced before its rename"
    assert log.paths[-1] == out.parent.resolve()  # the rename into place, made durable last


def test_a_checkpoint_is_fsynced_whole_before_its_rename_and_its_root_after(tmp_path, monkeypatch):
    from accelerate import Accelerator

    from dflashkit.train.checkpoint import save_checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    log = record_fsyncs(monkeypatch)
    final = save_checkpoint(Accelerator(cpu=True), model, optimizer, {"step": 7}, tmp_path, keep_last=2)
    written = {p.name for p in final.iterdir()}
    assert written >= {"checkpoint.json", "trainer.json", "model.safetensors", "optimizer.safetensors"}
    assert written <= log.names()
    temporary = final.parent.resolve() / ".tmp-step-00000007"
    assert log.paths[-2:] == [temporary, final.parent.resolve()]


def test_the_online_token_cache_is_written_durably(tmp_path, monkeypatch):
    from dflashkit.train.online import read_token_cache, write_token_cache

    samples = [SimpleNamespace(input_ids=np.arange(5), loss_mask=np.ones(5, dtype=bool), index=i) for i in range(2)]
    cache = tmp_path / "token-cache" / "key.safetensors"
    log = record_fsyncs(monkeypatch)
    write_token_cache(cache, samples, {})
    assert log.paths == [cache.parent.resolve() / ".key.safetensors.tmp", cache.parent.resolve()]
    assert sorted(p.name for p in cache.parent.iterdir()) == ["key.safetensors"]
    back, _ = read_token_cache(cache, say=print)
    assert [s.input_ids.tolist() for s in back] == [list(range(5))] * 2


def test_regenerates_merged_output_is_written_durably(tmp_path, monkeypatch):
    from dflashkit.extract.regenerate import merge_parts, part_path

    out = tmp_path / "regen.jsonl"
    for rank in range(2):
        part_path(out, rank, 2).write_text(f'{{"index": {rank + 2}}}\n{{"index": {rank}}}\n')
    log = record_fsyncs(monkeypatch)
    assert merge_parts(out, 2) == 4
    assert [int(line.split(": ")[1].rstrip("}")) for line in out.read_text().splitlines()] == [0, 1, 2, 3]
    assert log.paths == [tmp_path.resolve() / ".regen.jsonl.tmp", tmp_path.resolve()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen.jsonl"]
