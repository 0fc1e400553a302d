"""Online training with the target in vLLM (`train --target-engine vllm`, train/online_vllm.py) over the CPU twin of
a capturing vllm.LLM (support/vllm_capture_standin.py, which computes the features with the Hugging Face model): the
same samples, manifest, head and features as in-process online training, the same losses, held-out metrics,
checkpoints and export; the refusals name the field. The real engine is proven on the GPU."""

import json
import sys
from pathlib import Path

import pytest
import torch

from dflashkit.errors import UserError
from dflashkit.targets.vllm.api import VllmApi
from dflashkit.targets.vllm.capture import VllmCaptureConfig
from dflashkit.targets.vllm.runtime import MISSING_VLLM
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support import vllm_capture_standin as standin
from support.chat_data import chat_records, save_tiny_chat_target, write_jsonl
from support.training import ONLINE_MAX_LENGTH as MAX_LENGTH
from support.training import online_overrides
from support.training import train_losses as losses

LAYERS = [1, 2]  # the tiny target has 4 layers; 3 (the last) is refused with target_engine=vllm


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(tiny target with the testbed tokenizer, chat jsonl with one bad line): 10 samples."""
    root = tmp_path_factory.mktemp("online-vllm")
    target = save_tiny_chat_target(root / "target")
    return target, write_jsonl(root / "chats.jsonl", chat_records(10, seed=5), bad_lines={3: "{not json"})


def overrides(out, **kw) -> dict:
    return online_overrides(out, **{"target_layer_ids": LAYERS, **kw})


def standin_api(engines: list) -> VllmApi:
    """The twin, recording each engine it starts (``engines``) and the prompts of each generate call."""

    class Recording(standin.LLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.calls = []
            engines.append(self)

        def generate(self, prompts, sampling_params=None, use_tqdm=True):
            self.calls.append(len(prompts))
            return super().generate(prompts, sampling_params, use_tqdm)

    return VllmApi(Recording, standin.SamplingParams)


def test_the_vllm_path_hands_the_trainer_the_in_process_samples_and_features(chat, tmp_path, scratch):
    from dflashkit.train.online import OnlineFeatures, open_online
    from dflashkit.train.online_vllm import VllmOnlineFeatures, open_online_vllm

    target_dir, data = chat
    cfg = load_config(None, [], **overrides(tmp_path / "run", target=target_dir, data=[data], token_cache=False,
                                            target_engine="vllm"))
    target, head, manifest, samples = open_online(cfg, "cpu", torch.float32, say=lambda _: None)
    info, head_v, manifest_v, samples_v = open_online_vllm(cfg, "cpu", torch.float32, say=lambda _: None)
    assert not hasattr(info, "model")  # described, not loaded: the weights live in the engine
    assert manifest_v == manifest and manifest["target_layer_ids"] == LAYERS
    assert [s.index for s in samples_v] == [s.index for s in samples] and len(samples) == 10
    want_head, got_head = head.state_dict(), head_v.state_dict()
    assert sorted(got_head) == sorted(want_head)
    assert all(torch.equal(got_head[k], want_head[k]) for k in want_head)

    with OnlineFeatures(target, samples, LAYERS, store_last_hidden=False, batch_tokens=1, device="cpu") as alone:
        want = [alone[i] for i in range(len(samples))]
    engines = []
    config = VllmCaptureConfig(dtype="float32", max_model_len=MAX_LENGTH + 1)
    with VllmOnlineFeatures(info, samples_v, LAYERS, config=config, api=standin_api(engines), batch_tokens=4096,
                            device="cpu") as engine:
        order = list(range(len(samples)))[::-1]
        engine.plan(order)
        got = {i: engine[i] for i in order}
        assert len(engine._cache) > 1  # the planned reads ran several samples in one engine call
        engine.plan([])
        extra = engine[order[0]]  # out of plan: alone
    assert len(engines) == 1 and engines[0].aux_ids == [2, 3]  # target layer i is vLLM's aux id i + 1
    assert sum(engines[0].calls) == len(samples) + 1 and len(engines[0].calls) < len(samples)
    assert torch.equal(extra["hidden"], got[order[0]]["hidden"])
    for i in order:
        a, b = got[i], want[i]
        assert sorted(a) == sorted(b) == ["hidden", "input_ids", "loss_mask", "sample_index"]
        assert a["sample_index"] == b["sample_index"]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["hidden"].dtype == b["hidden"].dtype == torch.bfloat16
        assert a["hidden"].shape == b["hidden"].shape == (len(samples[i].input_ids), len(LAYERS) * 32)
        assert torch.equal(a["hidden"], b["hidden"]), i  # each sample alone in float32 on both paths: bit for bit
    assert not list(scratch.iterdir())  # the engine's per-request files and folder are gone


def test_training_with_the_target_in_vllm_equals_in_process_online_training(chat, tmp_path, scratch, monkeypatch,
                                                                            capsys):
    import dflashkit.targets.loading as loading

    target_dir, data = chat
    hf = train(load_config(None, [], **overrides(tmp_path / "hf", target=target_dir, data=[data],
                                                 target_batch_tokens=1)))
    loaded = []  # every target loaded with its weights, in this process (the twin's engine included)
    load_target = loading.load_target
    monkeypatch.setattr(loading, "load_target", lambda spec, **kw: loaded.append(str(spec)) or load_target(spec, **kw))
    capsys.readouterr()
    engines = []
    vl = train(load_config(None, [], **overrides(tmp_path / "vllm", target=target_dir, data=[data],
                                                 target_engine="vllm", target_gpu_memory_utilization=0.7)),
               vllm_api=standin_api(engines))
    log = capsys.readouterr().out
    assert "online data: 10 samples" in log and "online, target in vLLM, 8 training / 2 held-out samples" in log
    assert len(loaded) == 1 and len(engines) == 1  # only the engine's: the trainer never loads the target
    kwargs = engines[0].engine_kwargs
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["gpu_memory_utilization"] == 0.7
    assert kwargs["max_model_len"] == MAX_LENGTH + 1 and kwargs["enable_prefix_caching"] is False
    a, b = losses(tmp_path / "hf"), losses(tmp_path / "vllm")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]  # 8 samples, 2 micro-batches a step
    for step in a:  # the same features bit for bit (each sample alone in float32 on both paths): the same run
        assert b[step] == a[step], step
    for key in ("eval/loss", "eval/tau_sim", "eval/acc"):
        assert vl[key] == hf[key], key
    for summary in (hf, vl):  # the load's parts timed on both paths: the data's encoding, the target, the drafter
        st = summary["startup"]
        assert all(st[k] > 0 for k in ("data_s", "target_s", "drafter_s"))
        assert st["data_s"] + st["target_s"] + st["drafter_s"] <= st["load_s"]
    from safetensors.torch import load_file

    wa = load_file(str(Path(hf["checkpoint"]) / "model.safetensors"))
    wb = load_file(str(Path(vl["checkpoint"]) / "model.safetensors"))
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert sorted(p.name for p in (tmp_path / "vllm" / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    exported = json.loads((Path(vl["export_dir"]) / "config.json").read_text())
    assert exported["dflash_config"]["target_layer_ids"] == LAYERS
    assert (Path(vl["export_dir"]) / "model.safetensors").is_file()
    saved = json.loads((Path(vl["checkpoint"]) / "trainer.json").read_text())["config"]
    assert saved["target_engine"] == "vllm" and saved["target_gpu_memory_utilization"] == 0.7
    assert not list(scratch.iterdir())  # the engine was closed with the run


def test_what_vllm_cannot_give_is_refused_naming_the_field(chat, tmp_path, scratch):
    target_dir, data = chat
    base = dict(target=target_dir, data=[data], target_engine="vllm")
    for fields, message in (
            (dict(target_engine="sglang"), r"^target_engine: 'sglang'; use 'hf' .* or 'vllm'"),
            (dict(loss="kl"), r"^loss=kl with target_engine=vllm: .*final-norm output.*use loss=dpace"),
            (dict(labels="target_argmax"), r"^labels=target_argmax with target_engine=vllm: .*use labels=data"),
            (dict(target_tensor_parallel_size=0), r"^target_tensor_parallel_size must be >= 1, got 0"),
            (dict(target_gpu_memory_utilization=1.5), r"^target_gpu_memory_utilization must be in \(0, 1\]")):
        with pytest.raises(UserError, match=message):
            load_config(None, [], **overrides(tmp_path / "a", **{**base, **fields}))
    with pytest.raises(UserError, match=r"^target_engine=vllm with shards='s': .*runs no target"):
        load_config(None, [], **overrides(tmp_path / "a", shards="s", target_engine="vllm"))
    load_config(None, [], **overrides(tmp_path / "a", **base, loss="ce"))  # the rest is accepted
    load_config(None, [], **overrides(tmp_path / "a", target=target_dir, data=[data], loss="kl"))  # hf: kl is fine
    # the last layer: vLLM reads it before the final norm; refused before an engine starts or a step is taken
    engines = []
    with pytest.raises(UserError, match=r"^target_engine=vllm: target_layer_ids \[1, 3\] include 3, the target's "
                                        r"last layer.*or train with target_engine=hf$"):
        train(load_config(None, [], **overrides(tmp_path / "b", **base, target_layer_ids=[1, 3])),
              vllm_api=standin_api(engines))
    assert engines == [] and not (tmp_path / "b" / "checkpoints").exists()


def test_one_process_and_a_missing_vllm_are_one_line(chat, tmp_path, capsys, monkeypatch):
    from dflashkit.train.online_vllm import engine_api

    target_dir, data = chat
    cfg = load_config(None, [], **overrides(tmp_path / "a", target=target_dir, data=[data], target_engine="vllm"))
    api = standin_api([])
    assert engine_api(cfg, api, world=1) is api
    assert engine_api(load_config(None, [], **overrides(tmp_path / "a", target=target_dir, data=[data])), api, 1) \
        is None  # hf: no engine
    with pytest.raises(UserError, match=r"^target_engine=vllm trains in one process: .*; 2 were launched$"):
        engine_api(cfg, api, world=2)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as it does without the extra
    capsys.readouterr()
    with pytest.raises(UserError, match=r"^" + MISSING_VLLM.replace("[", r"\[").replace("]", r"\]") + "$"):
        train(cfg)
    assert "online data" not in capsys.readouterr().out  # refused before the data was read
    assert not (tmp_path / "a" / "checkpoints").exists()


def test_cli_flags_reach_the_config(chat):
    from dflashkit.train.__main__ import config_from_args, parse_args

    target_dir, data = chat
    argv = ["--target", target_dir, "--data", data, "--target-engine", "vllm", "--tensor-parallel-size", "2",
            "--gpu-memory-utilization", "0.6", "mixed_precision=no"]
    cfg = config_from_args(parse_args(argv))
    assert (cfg.target_engine, cfg.target_tensor_parallel_size, cfg.target_gpu_memory_utilization) == ("vllm", 2, 0.6)
    cfg = config_from_args(parse_args(["--target", target_dir, "--data", data, "target_engine=vllm",
                                       "target_tensor_parallel_size=4"]))
    assert (cfg.target_engine, cfg.target_tensor_parallel_size, cfg.target_gpu_memory_utilization) == ("vllm", 4, 0.5)
    assert config_from_args(parse_args(["--target", target_dir, "--data", data])).target_engine == "hf"
    with pytest.raises(SystemExit):
        parse_args(["--target-engine", "sglang"])
