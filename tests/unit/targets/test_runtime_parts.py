"""The target's parts resolved once (targets/runtime/parts.py): a bare Hugging Face model and load_target find the
same modules for every family, and one attention-only rule decides which targets run on a static cache."""

import pytest
import torch
import transformers as tf

from dflashkit.targets.loading import load_target, target_parts
from dflashkit.targets.runtime.parts import TargetParts, attention_only, find_decoder, layer_types

from support.tiny_targets import TINY_FAMILIES, hf_model, save_tiny_target, tiny_family_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

RECURRENT = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_bare_model_and_load_target_resolve_the_same_parts(family, tmp_path):
    target = load_target(save_tiny_target(family, tmp_path / family))
    bare = target_parts(target.model)
    assert isinstance(target, TargetParts) and target_parts(target) is target  # resolved once, handed on as is
    for name in ("decoder", "layers", "embed_tokens", "final_norm", "lm_head"):
        assert getattr(bare, name) is getattr(target, name), name
    assert bare.embedding_scale == target.embedding_scale  # the family's (sqrt(hidden) for Gemma 3)
    assert bare.num_layers == target.num_layers == 4 and bare.vocab_size == target.vocab_size
    assert attention_only(bare) == attention_only(target) == (family not in RECURRENT)
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():  # embed() is what the first decoder layer sees
        assert torch.equal(bare.embed(ids), target.decoder.embed_tokens(ids))


def test_the_parts_of_a_loaded_target_run_its_forward(tmp_path):
    """The resolved decoder + final norm + lm_head give the model's own logits."""
    target_dir = save_tiny_target("qwen3", tmp_path / "t")
    model = hf_model(target_dir)
    parts = target_parts(model)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        hidden = parts.decoder(input_ids=ids).last_hidden_state  # the decoder's output is after its final norm
        torch.testing.assert_close(parts.lm_head(hidden), model(input_ids=ids).logits)


def test_the_attention_only_rule():
    assert layer_types(tf.LlamaConfig(num_hidden_layers=3)) == ["full_attention"] * 3  # no layer_types: full
    assert attention_only(tf.LlamaConfig(num_hidden_layers=3))
    gemma = tiny_family_config("gemma3_text")
    assert {"sliding_attention", "full_attention"} == set(layer_types(gemma)) and attention_only(gemma)
    assert not attention_only(tiny_family_config("qwen3_5_text"))  # linear attention beside full attention
    mixed = tf.LlamaConfig(num_hidden_layers=2)
    mixed.layer_types = ["full_attention", "chunked_attention"]  # a chunk mask no static cache of ours builds
    assert not attention_only(mixed)


def test_a_model_without_a_known_decoder_layout_names_the_paths():
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel: found no text decoder .* model\.model\.language_model"):
        find_decoder(model)
