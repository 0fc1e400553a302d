"""Mask token resolution: explicit id, else the tokenizer's mask token, else an embedding row past the tokenizer's
vocabulary, else an error that asks for --mask-token-id."""

import pytest
import transformers as tf

from dflashkit.drafter import DrafterConfig
from dflashkit.targets.loading import resolve_mask_token_id

from support.tiny_targets import tiny_tokenizer


@pytest.fixture
def tokenizer():
    return tiny_tokenizer(num_words=240)  # 244 tokens


def test_explicit_id_wins_and_the_drafter_config_range_checks_it(tokenizer):
    config = tf.Qwen3Config(vocab_size=300, num_hidden_layers=12)  # deep enough for 5 distinct default taps
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    assert resolve_mask_token_id(None, config, explicit=7) == 7  # an explicit id needs no tokenizer
    assert resolve_mask_token_id(tokenizer, config, explicit=299) == 299
    assert DrafterConfig.for_target(config, mask_token_id=299).mask_token_id == 299
    for bad in (300, -1):  # the one range check: every resolved id ends in a DrafterConfig
        with pytest.raises(ValueError, match=rf"mask_token_id {bad} is outside the target's vocabulary \(0..299\)"):
            DrafterConfig.for_target(config, mask_token_id=resolve_mask_token_id(tokenizer, config, explicit=bad))


def test_tokenizer_mask_token_comes_next(tokenizer):
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    assert resolve_mask_token_id(tokenizer, tf.Qwen3Config(vocab_size=300)) == tokenizer.convert_tokens_to_ids("<mask>")
    assert tokenizer.mask_token_id == 244


def test_first_embedding_row_past_the_tokenizer(tokenizer):
    assert len(tokenizer) == 244 and tokenizer.mask_token_id is None
    assert resolve_mask_token_id(tokenizer, tf.Qwen3Config(vocab_size=300)) == 244
    # multimodal configs: the text config's vocabulary counts
    gemma = tf.Gemma3Config(text_config={"model_type": "gemma3_text", "vocab_size": 250})
    assert resolve_mask_token_id(tokenizer, gemma) == 244


def test_no_free_row_asks_for_an_explicit_id(tokenizer):
    with pytest.raises(ValueError, match="no mask_token_id.*--mask-token-id"):
        resolve_mask_token_id(tokenizer, tf.Qwen3Config(vocab_size=244))
