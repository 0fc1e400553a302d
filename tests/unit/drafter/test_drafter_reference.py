"""The export is compatible with the reference implementation (PyPI `dflash`, its own code): both directions."""

import json

import dflash.model as ref  # the reference package: a dev dependency (pyproject), so a missing one fails
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, Qwen3Config

from dflashkit.drafter import DrafterConfig, build_drafter, load_drafter, save_drafter

from support.exports import forward_without_dflashkit, rel_err

TARGET = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=10, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=320, rope_theta=5e5)
LAYOUTS = {
    "full": dict(num_hidden_layers=3),
    "mixed": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  sliding_window=5),
    "causal": dict(num_hidden_layers=3, causal=True),  # causal inside the block, whole context (is_causal)
}


def _inputs(cfg, ctx=7, start=0):
    q = cfg.block_size
    return dict(position_ids=torch.arange(start, start + ctx + q)[None],
                noise_embedding=torch.randn(1, q, cfg.hidden_size),
                target_hidden=torch.randn(1, ctx, cfg.num_taps * cfg.hidden_size))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_export_loads_into_reference_with_same_outputs(tmp_path, layout):
    cfg = DrafterConfig.for_target(TARGET, block_size=6, mask_token_id=319, **LAYOUTS[layout])
    ours = build_drafter(cfg).eval()
    save_drafter(ours, tmp_path / "d")
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    assert theirs.target_layer_ids == cfg.target_layer_ids
    assert theirs.block_size == 6 and theirs.mask_token_id == 319
    with torch.no_grad():
        for ctx in (3, 11):  # context shorter and longer than the sliding window
            x = _inputs(cfg, ctx=ctx)
            assert rel_err(ours(**x), theirs(**x)) <= 1e-5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cached_decoding_matches_reference(tmp_path, layout):
    """Two rounds with a DynamicCache cropped like the reference's decode loop."""
    cfg = DrafterConfig.for_target(TARGET, block_size=4, mask_token_id=319, **LAYOUTS[layout])
    ours = build_drafter(cfg).eval()
    save_drafter(ours, tmp_path / "d")
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    caches = [DynamicCache(), DynamicCache()]
    start = 0
    with torch.no_grad():
        for ctx in (5, 3):
            x = _inputs(cfg, ctx=ctx, start=start)
            outs = [m(**x, past_key_values=c, use_cache=True) for m, c in zip((ours, theirs), caches)]
            assert rel_err(*outs) <= 1e-5
            start += ctx
            for c in caches:  # keep only the context (negative crop works on transformers 5.17 and 5.24)
                c.crop(start - c.get_seq_length())


def test_a_causal_drafter_proposes_the_same_first_positions_for_any_block_length(tmp_path):
    """Causal inside the block: the first j + 1 outputs of a block of B do not depend on the B - 1 - j positions
    after them, in dflashkit's model and in the reference loaded from the export (what lets an engine ask for any
    k <= B - 1 tokens); the non-causal default does depend on them."""
    for causal in (True, False):
        cfg = DrafterConfig.for_target(TARGET, block_size=8, mask_token_id=319, num_hidden_layers=2, causal=causal)
        ours = build_drafter(cfg).eval()
        save_drafter(ours, tmp_path / f"d{causal}")
        theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / f"d{causal}"), dtype=torch.float32).eval()
        x = _inputs(cfg, ctx=9)
        for model in (ours, theirs):
            with torch.no_grad():
                whole = model(**x)
                for j in (1, 3):
                    short = dict(x, position_ids=x["position_ids"][:, :9 + j + 1],
                                 noise_embedding=x["noise_embedding"][:, :j + 1])
                    err = rel_err(model(**short), whole[:, :j + 1])
                    assert (err <= 1e-5) if causal else (err > 1e-3)


def test_reference_saved_drafter_loads_into_dflashkit(tmp_path):
    hf = Qwen3Config(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=16, vocab_size=320, num_target_layers=12,
                     dflash_config={"target_layer_ids": [1, 4, 8], "mask_token_id": 7, "block_size": 8})
    theirs = ref.DFlashDraftModel(hf).eval()
    theirs.save_pretrained(str(tmp_path / "r"))
    ours = load_drafter(tmp_path / "r")
    assert ours.target_layer_ids == [1, 4, 8] and ours.mask_token_id == 7 and ours.block_size == 8
    x = _inputs(ours.dflash, ctx=9)
    with torch.no_grad():
        assert rel_err(ours(**x), theirs(**x)) <= 1e-5


def test_export_loads_with_automodel_without_dflashkit(tmp_path):
    cfg = DrafterConfig.for_target(TARGET, block_size=4, mask_token_id=319, **LAYOUTS["mixed"])
    ours = build_drafter(cfg).eval()
    save_drafter(ours, tmp_path / "d")
    x = _inputs(cfg, ctx=6)
    with torch.no_grad():
        expected = ours(**x)
    assert rel_err(forward_without_dflashkit(tmp_path / "d", x, tmp_path, "DFlashDraftModel"), expected) <= 1e-6


def test_config_json_has_serving_fields(tmp_path):
    cfg = DrafterConfig.for_target(TARGET, block_size=16, mask_token_id=5, **LAYOUTS["mixed"])
    save_drafter(build_drafter(cfg), tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    assert data["architectures"] == ["DFlashDraftModel"] and data["model_type"] == "qwen3"
    assert data["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": cfg.target_layer_ids, "block_size": 16}
    assert data["rope_parameters"]["rope_theta"] == 5e5 and data["rope_theta"] == 5e5
    assert data["vocab_size"] == 320 and data["num_target_layers"] == 10
    assert data["layer_types"] == LAYOUTS["mixed"]["layer_types"] and data["sliding_window"] == 5
    module, cls = data["auto_map"]["AutoModel"].split(".")
    assert (tmp_path / "d" / f"{module}.py").is_file() and cls == "DFlashDraftModel"


@pytest.mark.slow
def test_spec_generate_gives_the_reference_tokens_on_the_testbed(tmp_path):
    """`spec_generate` of the shipped modeling file against the reference's, same drafter, same target
    (SmolLM2 testbed, fp32, CPU): greedy, and sampled with one seed (same random draws in the same order)."""
    from transformers import AutoModel

    from dflashkit.targets.loading import load_target

    target = load_target("testbed:smollm2")
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, num_hidden_layers=2, block_size=4,
                                   mask_token_id=target.vocab_size - 1)
    save_drafter(build_drafter(cfg), tmp_path / "d")
    ours = AutoModel.from_pretrained(str(tmp_path / "d"), trust_remote_code=True, dtype=torch.float32)
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32)
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                                  add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
    for temperature in (0.0, 1.0):
        outs = []
        for model in (ours, theirs):
            torch.manual_seed(1)
            outs.append(model.spec_generate(target.model, prompt, max_new_tokens=8,
                                            stop_token_ids=[target.tokenizer.eos_token_id], temperature=temperature,
                                            top_p=0.9 if temperature else 1.0))
        assert outs[0].shape[1] > prompt.shape[1]
        assert torch.equal(outs[0], outs[1]), temperature


@pytest.mark.parametrize("fields", [{"is_causal": True}, {"is_causal": False}, {"hidden_act": "gelu"},
                                    {"dflash_config": {"output_multiplier": 2.0, "final_logit_softcapping": 3.0}}])
def test_shipped_modeling_file_honours_reference_fields(tmp_path, fields):
    """Reference config fields the dflashkit trainer never writes are honoured by the shipped modeling file
    exactly as the reference honours them (forward and compute_logits)."""
    from dflashkit.drafter import DFlashDraftModel

    cfg = DrafterConfig.for_target(TARGET, block_size=4, mask_token_id=319, **LAYOUTS["mixed"])
    save_drafter(build_drafter(cfg), tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    for key, value in fields.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    (tmp_path / "d" / "config.json").write_text(json.dumps(data))
    ours = DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with torch.no_grad():
        x = _inputs(cfg, ctx=9)
        hidden = ours(**x)
        assert rel_err(hidden, theirs(**x)) <= 1e-5
        assert rel_err(ours.compute_logits(hidden, head), theirs.compute_logits(hidden, head)) <= 1e-6
    plain = build_drafter(cfg).eval()
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():  # the field changed something (so the comparison above is not vacuous)
        assert not torch.equal(ours.compute_logits(ours(**x), head), plain.compute_logits(plain(**x), head))


@pytest.mark.parametrize("fields", [{"dflash_config": {"conv_kernel_size": 4, "conv_group_size": 8}},
                                    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                         "partial_rotary_factor": 0.25}}])
def test_shipped_modeling_file_refuses_what_it_does_not_implement(tmp_path, fields):
    from dflashkit.drafter import DFlashDraftModel

    save_drafter(build_drafter(DrafterConfig.for_target(TARGET, mask_token_id=319)), tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    for key, value in fields.items():
        data[key] = {**data[key], **value}
    (tmp_path / "d" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="conv_kernel_size|partial"):
        DFlashDraftModel.from_pretrained(str(tmp_path / "d"))
