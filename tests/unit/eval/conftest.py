"""Fixtures of the eval tests (helpers: tests/support/)."""

import pytest
import transformers as tf

from support.chat_data import save_tiny_chat_target, smollm2_tokenizer


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """(root, tokenizer): a tiny random Llama saved with the testbed's tokenizer in root/target and a random
    1-layer drafter export for it (block 4, mask token 0) in root/drafter."""
    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter

    root = tmp_path_factory.mktemp("eval_cli")
    target = save_tiny_chat_target(root / "target", seed=0)
    config = tf.AutoConfig.from_pretrained(target)
    drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=4, mask_token_id=0))
    save_drafter(drafter, root / "drafter")
    return root, smollm2_tokenizer()
