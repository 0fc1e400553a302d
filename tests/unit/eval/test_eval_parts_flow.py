"""The target's parts are resolved once per run and handed down: run_eval gives the decoder its loaded Target, the
decoder gives the same parts to its verifier; the decoder is a context manager that gives the target back."""

import pytest
import torch
from transformers import LlamaForCausalLM

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.eval import run as eval_run
from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder
from dflashkit.eval.options import EvalOptions
from dflashkit.targets.loading import target_parts
from dflashkit.targets.runtime.parts import TargetParts

from support.tiny_targets import VOCAB, tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_decoder_hands_its_parts_to_the_verifier_and_gives_the_target_back():
    torch.manual_seed(0)
    config = tiny_target_config()
    model = LlamaForCausalLM(config).eval()
    drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=4,
                                                     mask_token_id=VOCAB - 1)).eval()
    parts = target_parts(model)
    before = model.config._attn_implementation
    with SpeculativeDecoder(parts, drafter, DecodeConfig(max_new_tokens=4)) as decoder:
        assert decoder.parts is parts and decoder.verifier.parts is parts  # resolved once, handed down
        assert model.config._attn_implementation != before
        decoder.generate([1, 2, 3])
    assert model.config._attn_implementation == before  # closed on leaving the block


def test_run_eval_hands_its_loaded_target_to_the_decoder(chat_pair, tmp_path, monkeypatch):
    seen = []

    class Recording(SpeculativeDecoder):
        def __init__(self, target, drafter, config):
            super().__init__(target, drafter, config)
            seen.append((target, self))

        def close(self):
            seen.append("closed")
            super().close()

    monkeypatch.setattr(eval_run, "SpeculativeDecoder", Recording)
    root, _ = chat_pair
    eval_run.run_eval(EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"), out=tmp_path / "r",
                                  dataset=["builtin:mtbench"], max_new_tokens=4, num_prompts=1, no_stop=True))
    (target, decoder), closed = seen
    assert isinstance(target, TargetParts) and hasattr(target, "tokenizer")  # the Target load_target returned
    assert decoder.parts is target and decoder.verifier.parts is target and closed == "closed"
