"""A tiny random target/drafter pair and the CPU twin of vllm.LLM, as the `eval --engine vllm` tests use them."""

import json
from pathlib import Path

import torch
import transformers as tf

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.targets.vllm.api import VllmApi

from . import vllm_standin
from .tiny_targets import VOCAB, tiny_target_config, tiny_tokenizer

# the pair's chat template: the turns' words, a blank line between turns (the word tokenizer has no turn markers)
JOINED_TURNS = "{{ messages | map(attribute='content') | join('\n\n') }}"


def write_pair(root: Path, block_size: int, causal: bool = False, chats: int = 4) -> Path:
    """``root``/target (a 6-token random Llama, word tokenizer w0/w1), ``root``/drafter (random, for it) and
    ``root``/chats.jsonl (``chats`` two-turn chats of random words)."""
    torch.manual_seed(0)
    config = tiny_target_config(initializer_range=1.0)
    tf.LlamaForCausalLM(config).save_pretrained(root / "target")
    tokenizer = tiny_tokenizer(num_words=2)
    tokenizer.chat_template = JOINED_TURNS
    tokenizer.save_pretrained(root / "target")
    save_drafter(build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=block_size,
                                                        mask_token_id=VOCAB - 1, initializer_range=0.02,
                                                        causal=causal)), root / "drafter")
    g = torch.Generator().manual_seed(1)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 2, (n,), generator=g))

    with open(root / "chats.jsonl", "w") as f:
        for k in range(chats):
            f.write(json.dumps({"id": f"c{k}", "messages": [{"role": "user", "content": words(10)},
                                                           {"role": "user", "content": words(6)}]}) + "\n")
    return root


def standin_api(version: str = vllm_standin.VERSION) -> VllmApi:
    """The twin's LLM and SamplingParams, following vLLM ``version``, sharing one modelled clock with whoever
    times them."""
    return vllm_standin.standin_api(version)
