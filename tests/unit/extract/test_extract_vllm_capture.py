"""`dflashkit extract --engine vllm` over the CPU twin of a capturing vllm.LLM (support/vllm_capture_standin.py) on
a tiny random Llama with the testbed's tokenizer: the shards equal Hugging Face extraction's, verify passes, the
manifest names the engine, a run cut short and resumed equals an uninterrupted one, a missing vLLM is one line,
and target layer i is read from vLLM's aux id i + 1."""

import fcntl
import json
import os
import sys
import threading
import time

import pytest
import torch

from dflashkit.cli import run_main
from dflashkit.errors import UserError
from dflashkit.extract.__main__ import main as extract_main
from dflashkit.extract.options import ExtractOptions
from dflashkit.extract.run import extract
from dflashkit.extract.shards.manifest import read_manifest
from dflashkit.extract.shards.reader import ShardDataset
from dflashkit.extract.shards.verify import verify_dataset
from dflashkit.targets.vllm.api import VllmApi
from dflashkit.targets.vllm.capture import (
    VllmCapture,
    VllmCaptureConfig,
    engine_kwargs,
    read_request_file,
)
from dflashkit.targets.vllm.runtime import MISSING_VLLM

from support import vllm_capture_standin as standin
from support.chat_data import chat_records, save_tiny_chat_target, write_jsonl
from support.tiny_targets import hf_model

LAYERS = [0, 2]  # the tiny target has 4 layers; 3 (the last) is refused with --engine vllm
FLAGS = {"layer_ids": LAYERS, "batch_tokens": 300, "bucket_window": 8, "shard_size": 1, "progress": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")


def standin_api(fail_at_call: int | None = None) -> VllmApi:
    """The twin; with ``fail_at_call`` its generate raises on that call (a run cut short mid-way)."""
    calls = []

    class CutShort(standin.LLM):
        def generate(self, prompts, sampling_params=None, use_tqdm=True):
            calls.append(1)
            if len(calls) == fail_at_call:
                raise RuntimeError("engine died")
            return super().generate(prompts, sampling_params, use_tqdm)

    return VllmApi(CutShort, standin.SamplingParams)


def extract_with(target, data, out, vllm_api=None, **flags) -> dict:
    """The library call: ``run.extract`` of the options ``flags`` give, with the vLLM calls ``vllm_api``."""
    return extract(ExtractOptions(target=target, data=[data], out=out, **flags), vllm_api=vllm_api)


def by_index(out):
    ds = ShardDataset(out)
    return {ds[k]["sample_index"]: ds[k] for k in range(len(ds))}


def test_vllm_shards_equal_hf_shards_and_verify(tiny, tmp_path, scratch):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(10, seed=4), [(3, "{broken")])
    hf = extract_with(tiny, data, tmp_path / "hf", **FLAGS)
    vl = extract_with(tiny, data, tmp_path / "vllm", engine="vllm", vllm_api=standin_api(), **FLAGS)
    assert hf["engine"] == {"name": "hf"}
    assert vl["engine"] == {"name": "vllm", "version": "stand-in", "tensor_parallel_size": 1}
    assert read_manifest(tmp_path / "vllm")["engine"]["name"] == "vllm"
    same = ("target", "tokenizer_hash", "chat_template_hash", "target_layer_ids", "feature_dim", "dtype", "skipped",
            "notes", "args")
    assert {k: vl[k] for k in same} == {k: hf[k] for k in same}
    assert vl["totals"]["tokens"] == hf["totals"]["tokens"] and len(vl["shards"]) == len(hf["shards"]) >= 3
    assert [s["sample_indices"] for s in vl["shards"]] == [s["sample_indices"] for s in hf["shards"]]  # order
    assert verify_dataset(tmp_path / "vllm") == ([], [])
    got, want = by_index(tmp_path / "vllm"), by_index(tmp_path / "hf")
    assert sorted(got) == sorted(want) and len(want) == 10
    for i, w in want.items():
        assert torch.equal(got[i]["input_ids"], w["input_ids"]) and torch.equal(got[i]["loss_mask"], w["loss_mask"])
        torch.testing.assert_close(got[i]["hidden"].float(), w["hidden"].float(), rtol=2 ** -7, atol=1e-5)
    assert not list(scratch.iterdir())  # the engine's per-request files and folder are gone


def test_a_run_cut_short_then_resumed_equals_an_uninterrupted_one(tiny, tmp_path, scratch):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(12, seed=5))
    ref = tmp_path / "ref"
    extract_with(tiny, data, ref, engine="vllm", vllm_api=standin_api(), **FLAGS)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="engine died"):
        extract_with(tiny, data, out, engine="vllm", vllm_api=standin_api(fail_at_call=3), **FLAGS)
    listed = json.loads((out / "manifest.json").read_text())["shards"]
    assert 0 < len(listed) < len(read_manifest(ref)["shards"])  # cut mid-way, the shards before kept
    assert verify_dataset(out)[0] == [] and not list(scratch.iterdir())
    with pytest.raises(UserError, match="engine.name"):  # the features of one directory come from one engine
        extract_with(tiny, data, out, resume=True, **FLAGS)
    extract_with(tiny, data, out, engine="vllm", vllm_api=standin_api(), resume=True, **FLAGS)
    got, want = by_index(out), by_index(ref)
    assert sorted(got) == sorted(want) and len(ShardDataset(out)) == len(want) == 12
    for i, w in want.items():
        assert all(torch.equal(got[i][k], w[k]) for k in ("input_ids", "loss_mask", "hidden"))
    assert read_manifest(out)["totals"]["tokens"] == read_manifest(ref)["totals"]["tokens"]
    assert verify_dataset(out) == ([], [])


def test_missing_vllm_is_one_line_before_any_work(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "out"
    rc = run_main("dflashkit extract", extract_main, ["--target", tiny, "--data", data, "--out", str(out),
                                                      "--engine", "vllm", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().count("\n") == 0 and MISSING_VLLM in err
    assert not out.exists() or not list(out.iterdir())


def test_what_vllm_captures_differently_is_refused(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    api = standin_api()
    with pytest.raises(UserError, match="before the final norm"):  # layer L-1: vLLM's is not HF's
        extract_with(tiny, data, tmp_path / "a", engine="vllm", vllm_api=api, layer_ids=[1, 3], progress=False)
    with pytest.raises(UserError, match="--store-last-hidden"):
        extract_with(tiny, data, tmp_path / "b", engine="vllm", vllm_api=api, layer_ids=[1], store_last_hidden=True,
                progress=False)
    with pytest.raises(UserError, match="one process"):
        extract_with(tiny, data, tmp_path / "c", engine="vllm", vllm_api=api, device_map="auto", progress=False)
    with pytest.raises(UserError, match="--engine 'sglang'"):
        extract_with(tiny, data, tmp_path / "d", engine="sglang", progress=False)


def test_target_layer_i_is_read_from_aux_id_i_plus_1(tiny, scratch):
    kwargs = engine_kwargs(tiny, [0, 2], VllmCaptureConfig(), "/x")
    assert kwargs["speculative_config"] == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                                                 [1, 3]}}}
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": "/x"}
    assert kwargs["enable_prefix_caching"] is False
    prompts = [[5, 9, 200, 7, 7, 31], [44, 3]]
    with VllmCapture(tiny, [0, 2], VllmCaptureConfig(), standin_api()) as capture:
        assert capture.llm.aux_ids == [1, 3]
        per_sample = capture(prompts)
    model = hf_model(tiny)
    for prompt, taps in zip(prompts, per_sample):
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        assert len(taps) == 2  # one [T, H] per tap, in target_layer_ids order: layer i is hidden_states[i + 1]
        for i, tap in zip([0, 2], taps):
            torch.testing.assert_close(tap, hs[i + 1][0], rtol=1e-5, atol=1e-6)
    assert not list(scratch.iterdir())


def test_a_request_file_is_read_after_its_writer_and_checked(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "0.safetensors")
    states = torch.randn(3, 2, 4)
    lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as the connector holds it while its writer thread saves

    def write_later():
        time.sleep(0.2)
        save_file({"hidden_states": states, "token_ids": torch.tensor([1, 2, 3])}, path)
        os.close(lock)

    writer = threading.Thread(target=write_later)
    writer.start()
    taps = read_request_file(path, [1, 2, 3], 2)
    writer.join()
    assert torch.equal(taps[0], states[:, 0]) and torch.equal(taps[1], states[:, 1])
    assert not os.path.exists(path) and not os.path.exists(path + ".lock")
    save_file({"hidden_states": states, "token_ids": torch.tensor([1, 2, 4])}, path)
    with pytest.raises(RuntimeError, match="another request"):
        read_request_file(path, [1, 2, 3], 2)
