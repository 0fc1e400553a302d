"""Eval's prompts read a record's turns with the one definition of the role names and of the opening turns
(extract/data/sources.py): OpenAI ``messages`` and ShareGPT ``conversations`` alike."""

import copy
import json

import pytest

from dflashkit.errors import UserError
from dflashkit.eval.prompts import load_prompts, multi_turn_prompts, opening_turns
from dflashkit.extract.data.rendering import BadSample, ChatConfig, NoChatTemplate, normalize_record, prompt_ids

from support.chat_data import smollm2_tokenizer
from support.chat_templates import LLAMA3, family_tokenizer

SHAREGPT = {"id": "s", "conversations": [{"from": "gpt", "value": "a leading answer"},
                                         {"from": "system", "value": "be brief"},
                                         {"from": "human", "value": "first question"},
                                         {"from": "chatgpt", "value": "first answer"},
                                         {"from": "human", "value": "second question"}]}
OPENAI = {"id": "o", "messages": [{"role": "user", "content": "first question"},
                                  {"role": "assistant", "content": "first answer"},
                                  {"role": "user", "content": "second question"}]}


def test_opening_turns_are_the_system_turns_and_the_first_user_turn():
    want = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first question"}]
    assert opening_turns(SHAREGPT, "x") == want
    assert opening_turns(OPENAI, "x") == want[1:]
    # the opening turns of what extraction makes of the record are the same
    _, messages, _ = normalize_record(SHAREGPT, require_assistant=False)
    assert opening_turns({"messages": messages}, "x") == want
    with pytest.raises(UserError, match="no user turn in its 'conversations'"):
        opening_turns({"conversations": [{"from": "gpt", "value": "an answer"}]}, "x")


def test_sharegpt_conversations_get_the_multi_turn_run_too(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (SHAREGPT, OPENAI, {"prompt": "one turn only"})))
    found = {name.split("#")[1]: (turns, second) for name, turns, second in multi_turn_prompts([str(data)], 10)}
    assert sorted(found) == ["o", "s"]  # the vLLM engine's multi-turn prefix-cache run takes both formats
    assert found["s"] == (opening_turns(SHAREGPT, "x"), "second question")
    assert found["o"] == (opening_turns(OPENAI, "x"), "second question")


# ---------------------------------------------------------------- one renderer for training and eval

TRAINING_RECORDS = [
    {"id": "pair", "system": "Be brief.", "prompt": "Name a colour.", "response": "Blue."},
    {"id": "chat", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello there!"},
                                {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome."}]},
    {"id": "sharegpt", "conversations": [{"from": "gpt", "value": "a leading answer"},
                                         {"from": "human", "value": "Name a colour."},
                                         {"from": "gpt", "value": "Blue."}]},
]
PERSONA = ("{% if persona is defined %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}"
           "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _before_first_answer(sample) -> list[int]:
    return sample.input_ids[:sample.loss_mask.index(True)]


@pytest.mark.parametrize("template, kwargs", [(None, {}), (LLAMA3, {}), (PERSONA, {"persona": "One line only."})])
def test_an_eval_prompt_is_the_training_sample_before_its_first_answer(tmp_path, template, kwargs):
    """The same record renders to the same tokens in training and eval, the tokenizer's template or a custom one
    with its kwargs: eval's prompt is the sample's tokens before its first supervised token (a prompt/response
    record keeps its system turn in both; eval dropped it before)."""
    from dflashkit.extract.data.chat import encode_record

    tok = smollm2_tokenizer() if template is None else family_tokenizer()
    chat = ChatConfig(chat_template=template, template_kwargs=kwargs)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRAINING_RECORDS))
    prompts = load_prompts(str(data), tok, chat=chat)
    assert [p.id for p in prompts] == ["pair", "chat", "sharegpt"]
    for record, prompt in zip(TRAINING_RECORDS, prompts):
        assert prompt.input_ids == _before_first_answer(encode_record(record, tok, chat)), record["id"]
    if kwargs:  # the kwargs reach the template
        plain = load_prompts(str(data), tok, chat=ChatConfig(chat_template=template))
        assert plain[0].input_ids != prompts[0].input_ids


def test_unknown_roles_get_the_training_rule_in_eval(tmp_path):
    """A record with a role training does not know is skipped by both (training: ``unknown_role``); eval used to
    drop the turn silently and render the rest. Eval says how many it skipped, and why."""
    from dflashkit.extract.data.chat import encode_record

    tool = {"id": "tool", "messages": [{"role": "user", "content": "What time is it?"},
                                       {"role": "tool", "content": "12:00"},
                                       {"role": "assistant", "content": "Noon."}]}
    with pytest.raises(BadSample) as e:
        encode_record(tool, smollm2_tokenizer(), ChatConfig())
    assert e.value.reason == "unknown_role"
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (tool, OPENAI, SHAREGPT | {"id": "s2"})))
    said = []
    prompts = load_prompts(str(data), smollm2_tokenizer(), warn=said.append)
    assert [p.id for p in prompts] == ["o", "s2"]
    assert said == [f"{data}: skipped 1 record (unknown_role 1), as training skips them"]
    found = [name.split("#")[1] for name, _, _ in multi_turn_prompts([str(data)], 10)]
    assert found == ["o", "s2"]


def test_a_tokenizer_without_a_template_needs_one_in_eval_as_in_training(tmp_path):
    """No chat template: training refuses and asks for --chat-template; eval used to join the turns with blank
    lines (tokens no training saw). Now both ask, and with --chat-template both render the same tokens."""
    bare = copy.deepcopy(smollm2_tokenizer())
    chatml = bare.chat_template
    bare.chat_template = None
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(OPENAI) + "\n")
    with pytest.raises(NoChatTemplate, match="--chat-template"):
        load_prompts(str(data), bare)
    with pytest.raises(NoChatTemplate, match="--chat-template"):
        prompt_ids(bare, OPENAI["messages"][:1], ChatConfig())
    given = load_prompts(str(data), bare, chat=ChatConfig(chat_template=chatml))[0]
    assert given.input_ids == load_prompts(str(data), smollm2_tokenizer())[0].input_ids
