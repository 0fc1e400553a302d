"""DSpark exports (the common export path, drafter/export.py, asking drafter/kinds/dspark.py) against a
transcription of what vLLM 0.26.0 reads (the wheel's sources, paths under vllm/), and loaded back by transformers
and dflashkit from the files they ship."""

import json

import pytest
import torch
from transformers import AutoModel, LlamaConfig

from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter, save_drafter
from dflashkit.errors import UserError

from support.exports import forward_without_dflashkit
from support.vllm_dspark import vllm_load, vllm_serving_settings

TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=60)

# ------------------------------------------------------------------ the tests
def dspark_state_dict(model) -> dict[str, torch.Tensor]:
    """The tensors an export holds: the model's own, without the RoPE tables."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}


def drafter(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(TARGET, num_hidden_layers=2, block_size=5, mask_token_id=59, architecture="dspark",
                                   markov_rank=6, **{"target_layer_ids": [1, 4, 6], **kw})
    model = build_drafter(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # every tensor distinct from its start (markov_w2 starts at 0)
    return cfg, model


@pytest.mark.parametrize("kw", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
                                {"causal": True}])
def test_vllm_026_loads_every_tensor_and_serves_the_trained_block(tmp_path, kw):
    cfg, model = drafter(**kw)
    out = save_drafter(model, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {"confidence_head.proj.weight", "markov_head.markov_w1.weight"} <= set(shapes)
    vllm_load(shapes, config)
    served = vllm_serving_settings(config, num_speculative_tokens=cfg.block_size - 1)
    assert served["method"] == "dspark" and served["mask_token_id"] == 59
    assert served["queries_per_request"] == cfg.block_size  # the anchor + block_size - 1 masks dflashkit trains
    assert served["aux_layers"] == [2, 5, 7]  # hidden_states[i + 1] of target_layer_ids [1, 4, 6]
    assert served["causal"] == [layer.self_attn.is_causal for layer in model.layers]
    if cfg.causal:  # the first j drafts do not depend on k >= j: any k is served
        assert vllm_serving_settings(config, num_speculative_tokens=2)["queries_per_request"] == 3
    else:  # a non-causal layer sees the whole block: fewer masks than trained is refused
        with pytest.raises(ValueError, match="dspark_block_size"):
            vllm_serving_settings(config, num_speculative_tokens=cfg.block_size - 2)


@pytest.mark.parametrize("change", ["drop markov_w2", "prefix model.", "fc for 2 taps"])
def test_the_transcription_refuses_what_vllm_would_not_load(tmp_path, change):
    cfg, model = drafter()
    config = json.loads(json.dumps(cfg.to_json_dict()))
    shapes = {k: tuple(v.shape) for k, v in dspark_state_dict(model).items()}
    if change == "drop markov_w2":
        del shapes["markov_head.markov_w2.weight"]
    elif change == "prefix model.":
        shapes = {"model." + k: v for k, v in shapes.items()}
    else:
        config["dflash_config"]["target_layer_ids"] = [1, 4]
    with pytest.raises(AssertionError):
        vllm_load(shapes, config)


def test_transformers_loads_the_export_without_dflashkit(tmp_path):
    cfg, model = drafter()
    out = save_drafter(model, tmp_path / "d")
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DSparkDraftModel" and loaded.markov_head.markov_w1.weight.shape == (60, 6)
    want = dspark_state_dict(model)
    got = dspark_state_dict(loaded)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    inputs = {"position_ids": torch.arange(9)[None], "noise_embedding": torch.randn(1, 5, 32),
              "target_hidden": torch.randn(1, 4, 96)}
    with torch.no_grad():
        torch.testing.assert_close(forward_without_dflashkit(out, inputs, tmp_path, "DSparkDraftModel"),
                                   model(**inputs))


def test_the_export_loads_back_as_the_same_dspark_drafter(tmp_path):
    cfg, model = drafter()
    out = save_drafter(model, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 6
    assert config["auto_map"] == {"AutoModel": "modeling_dspark.DSparkDraftModel"}
    loaded = load_drafter(out)
    assert loaded.dflash == cfg and type(loaded).__name__ == "DSparkDraftModel"
    want, got = dspark_state_dict(model), dspark_state_dict(loaded)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_config_naming_dspark_without_markov_rank_is_refused(tmp_path):
    _, model = drafter()
    out = save_drafter(model, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    del config["markov_rank"], config["dflash_config"]["markov_rank"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="markov_rank"):
        load_drafter(out)
