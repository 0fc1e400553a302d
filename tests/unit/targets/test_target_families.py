"""Target loading for every supported family: tiny random targets built from configs in code, saved to a
directory and loaded back the way a user would (`load_target(dir)`), checked against Hugging Face's own outputs.

The tiny-target builders (`TINY_FAMILIES`, `save_tiny_target`) live in tests/support/tiny_targets.py.
"""

import pytest
import torch
import transformers as tf

from dflashkit.targets.loading import FAMILIES, load_target, load_target_head

from support.tiny_targets import TINY_FAMILIES, save_tiny_target, tiny_family_config, tiny_tokenizer

EXPECTED_FAMILY = {"gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5",
                   "qwen3_5_moe": "qwen3_5_moe"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {f: save_tiny_target(f, root / f) for f in TINY_FAMILIES}


def _batch():
    ids = torch.randint(4, 244, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding in row 1
    return ids, mask


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_load_target_finds_the_parts_hf_uses(family, tiny_dirs):
    target = load_target(tiny_dirs[family])
    assert target.family == EXPECTED_FAMILY.get(family, family)
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, 300)
    assert not target.model.training
    ids, mask = _batch()
    last_layer_out = {}
    handle = target.layers[-1].register_forward_hook(
        lambda m, a, out: last_layer_out.setdefault("x", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    handle.remove()
    hs = out.hidden_states
    assert len(hs) == 5
    # embedding (with its scale) is what the first layer sees
    assert torch.equal(target.embed(ids), hs[0])
    assert target.embedding_scale == (8.0 if family.startswith("gemma3") else 1.0)
    # final norm turns the last layer's output into HF's last hidden state; lm_head gives the logits
    assert torch.equal(target.final_norm(last_layer_out["x"]), hs[-1])
    assert torch.allclose(target.lm_head(hs[-1]), out.logits, atol=1e-6, rtol=0)


def test_tied_lm_head_shares_the_embedding(tiny_dirs):
    tied, untied = load_target(tiny_dirs["llama"]), load_target(tiny_dirs["qwen3"])
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_load_target_head_equals_the_full_model(family, tiny_dirs, monkeypatch):
    target = load_target(tiny_dirs[family])

    def refuse(*args, **kwargs):
        raise AssertionError("load_target_head built a full model")

    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_config", refuse)
    head = load_target_head(tiny_dirs[family])
    ids = torch.randint(0, 300, (2, 7))
    x = torch.randn(2, 7, 64)
    assert type(head.final_norm) is type(target.final_norm)
    assert torch.equal(head.embed(ids), target.embed(ids))
    with torch.no_grad():
        assert torch.equal(head.final_norm(x), target.final_norm(x))
        assert torch.equal(head.lm_head(x), target.lm_head(x))
    assert (head.vocab_size, head.hidden_size, head.embedding_scale) == (300, 64, target.embedding_scale)
    assert head.identity() == target.identity()
    assert not any(p.requires_grad for p in head.parameters())


def test_load_target_head_reads_sharded_checkpoints(tmp_path):
    model = tf.AutoModelForCausalLM.from_config(tiny_family_config("qwen3"))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    tiny_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    head = load_target_head(tmp_path, dtype=torch.bfloat16)
    assert head.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(head.lm_head.weight, model.lm_head.weight.detach().bfloat16())
    assert torch.equal(head.embed_tokens.weight, model.model.embed_tokens.weight.detach().bfloat16())


def test_identity_hashes(tiny_dirs, tmp_path):
    target = load_target(tiny_dirs["qwen3"])
    ident = target.identity()
    assert ident["path"] == str(tiny_dirs["qwen3"].resolve())
    assert ident == load_target(tiny_dirs["qwen3"], dtype=torch.bfloat16).identity()  # load dtype changes nothing
    # the same model saved in bf16: same config, other weights; a changed config field: other config hash
    target.model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    target.tokenizer.save_pretrained(tmp_path / "bf16")
    other = load_target(tmp_path / "bf16").identity()
    assert other["config_hash"] == ident["config_hash"] and other["weights_hash"] != ident["weights_hash"]
    config = (tmp_path / "bf16" / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')
    (tmp_path / "bf16" / "config.json").write_text(config)
    assert load_target(tmp_path / "bf16").identity()["config_hash"] != ident["config_hash"]


def test_default_layer_ids_follow_the_reference():
    from dflash.model import build_target_layer_ids

    from dflashkit.targets.loading import Target

    for num_layers, n in [(30, 5), (36, 5), (28, 3), (48, 1)]:
        stub = Target(model=None, config=None, decoder=None, layers=[None] * num_layers, embed_tokens=None,
                      embedding_scale=1.0, final_norm=None, lm_head=None, tokenizer=None, path=None, model_dir=None,
                      family=None)
        assert stub.default_layer_ids(n) == build_target_layer_ids(num_layers, n)


def test_unsupported_architecture_names_it(tmp_path):
    config = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported.*llama, qwen2"):
        load_target(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        load_target_head(tmp_path)


def test_bad_specs_say_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="not an existing directory or .gguf file"):
        load_target(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        load_target(tmp_path)
    with pytest.raises(ValueError, match="unknown testbed.*testbed:smollm2"):
        load_target("testbed:nope")


def test_pickled_weights_are_refused(tmp_path):
    model = tf.AutoModelForCausalLM.from_config(tiny_family_config("qwen3"))
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="only safetensors are read"):
        load_target(tmp_path)


def test_families_cover_the_supported_model_types():
    for model_type in ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text",
                       "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "gpt_oss"]:
        assert model_type in FAMILIES


def test_cache_kwargs_follow_the_forward_signature(tiny_dirs):
    from dflashkit.targets.loading import cache_kwargs

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class NewStyle(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    assert cache_kwargs(OldStyle(), "c") == {"past_key_values": "c"}
    assert cache_kwargs(NewStyle(), "c") == {"cache": "c"}
    # the installed transformers: the kwarg it names is the one its forward declares
    import inspect

    model = load_target(tiny_dirs["qwen3"]).model
    (name,) = cache_kwargs(model, None)
    assert name in inspect.signature(type(model).forward).parameters
