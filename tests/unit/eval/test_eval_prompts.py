"""Eval's prompts read a record's turns with the one definition of the role names and of the opening turns
(extract/data/sources.py): OpenAI ``messages`` and ShareGPT ``conversations`` alike."""

import json

import pytest

from dflashkit.errors import UserError
from dflashkit.eval.prompts import multi_turn_prompts, opening_turns
from dflashkit.extract.data.rendering import normalize_record

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
