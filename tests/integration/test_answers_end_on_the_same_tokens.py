"""Regeneration (`dflashkit regenerate`: extract/generation/answerers.py) and eval (the default engine,
eval/run.py, and the vLLM engine, eval/vllm_engine.py) end an answer on the same token ids: the one set of
targets/chat_template.stop_token_ids (the generation config's eos ids, the tokenizer's eos, the token that closes
an assistant turn under the chat template)."""

from pathlib import Path

import transformers as tf

from dflashkit.eval.prompts import target_stop_ids
from dflashkit.eval.run import stop_ids
from dflashkit.extract.generation.answerers import AnswerSettings, TargetGenerator
from dflashkit.targets.loading import resolve_target_dir

from support.chat_data import save_tiny_chat_target


def stop_ids_of_each_command(target: str) -> dict[str, tuple[int, ...]]:
    regenerate = TargetGenerator(target, AnswerSettings(max_new_tokens=4), batch_size=16, device="cpu",
                                 dtype="float32", cuda_graph=False)
    target_dir, _ = resolve_target_dir(target)
    return {"regenerate": tuple(regenerate.stop_ids), "eval": stop_ids(regenerate.target),
            "eval --engine vllm": tuple(target_stop_ids(Path(target_dir), regenerate.tok))}


def test_testbed_answers_end_on_the_same_tokens():
    found = stop_ids_of_each_command("testbed:smollm2")
    assert len(set(found.values())) == 1, found
    im_end = tf.AutoTokenizer.from_pretrained(resolve_target_dir("testbed:smollm2")[0]).convert_tokens_to_ids(
        "<|im_end|>")
    assert im_end in found["eval"]  # the ChatML turn end


def test_a_generation_config_eos_list_ends_regenerated_answers_too(tmp_path):
    target = save_tiny_chat_target(tmp_path / "target")
    tok = tf.AutoTokenizer.from_pretrained(target)
    endoftext, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    tf.GenerationConfig(eos_token_id=[endoftext, 7]).save_pretrained(target)  # as Qwen3 lists two eos ids
    found = stop_ids_of_each_command(target)
    assert found["regenerate"] == found["eval"] == found["eval --engine vllm"] == tuple(sorted({endoftext, 7, im_end}))
