"""Chat data -> token ids + loss mask: for each template family, the supervised tokens decode to exactly the
assistant text plus the end-of-turn token; record formats; bad records by reason.

The SmolLM2 testbed tokenizer carries the ChatML template itself. The other families are small Jinja templates
written here after the real ones (Llama 3.1, Qwen3 with its reasoning handling, Gemma 2), on top of the same
tokenizer with their special tokens added (`smollm2_tokenizer` lives in tests/conftest.py). The templates are
reused by the other tests/test_extract_*.py files.
"""

import copy
import functools

import pytest

from dflashkit.extract.data.chat import (
    BadSample,
    ChatConfig,
    NoChatTemplate,
    TemplateError,
    chat_template_hash,
    check_template,
    encode_record,
    end_of_turn_token,
    tokenizer_hash,
)

from conftest import smollm2_tokenizer

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
GEMMA = (
    "{{ '<bos>' }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
# a template with no token that closes the assistant turn: spans cannot be marked
PLAIN = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}" \
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
FAMILY_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>",
                   "<start_of_turn>", "<end_of_turn>"]


@functools.lru_cache(maxsize=1)
def family_tokenizer():
    """The testbed tokenizer plus the special tokens of Llama 3 and Gemma, and Qwen3's (non-special) think tags."""
    tok = copy.deepcopy(smollm2_tokenizer())
    tok.add_tokens(FAMILY_SPECIALS, special_tokens=True)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def supervised_runs(tokenizer, sample) -> list[str]:
    runs, cur = [], []
    for t, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def _conv(first, second, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    return {"messages": msgs + [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
                                {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": second}]}


FAMILIES = {
    # name: (template or None for the tokenizer's own, template kwargs, record, expected supervised texts)
    "chatml-smollm2": (None, {}, _conv("Hello there!\n", " You're welcome. ", system="Be brief."),
                       ["Hello there!\n<|im_end|>", " You're welcome. <|im_end|>"]),
    "llama3": (LLAMA3, {}, _conv("Hello there!\n", " You're welcome. ", system="Be brief."),
               ["Hello there!<|eot_id|>", "You're welcome.<|eot_id|>"]),
    "gemma": (GEMMA, {}, _conv("Hello there!\n", " You're welcome. "),
              ["Hello there!<end_of_turn>", "You're welcome.<end_of_turn>"]),
    # thinking on: earlier turns lose their reasoning, the last keeps it
    "qwen3-thinking": (QWEN3, {}, _conv("<think>\nplan\n</think>\n\nHello there!",
                                        "<think>\nagain\n</think>\n\nYou're welcome.", system="Be brief."),
                       ["Hello there!<|im_end|>", "<think>\nagain\n</think>\n\nYou're welcome.<|im_end|>"]),
    # thinking off: the empty think block belongs to the generation prompt, not to the answer
    "qwen3-no-thinking": (QWEN3, {"enable_thinking": False}, _conv("Hello there!", "You're welcome."),
                          ["Hello there!<|im_end|>", "You're welcome.<|im_end|>"]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_supervised_tokens_decode_to_assistant_text_plus_end_of_turn(family):
    template, kwargs, record, expected = FAMILIES[family]
    tok = smollm2_tokenizer() if template is None else family_tokenizer()
    cfg = ChatConfig(chat_template=template, template_kwargs=kwargs)
    eot = check_template(tok, cfg)
    assert eot == expected[0][-len(eot):]
    sample = encode_record(record, tok, cfg)
    assert supervised_runs(tok, sample) == expected
    # each run ends with the end-of-turn token as one id; the whole sequence is the template's rendering
    eot_id = tok.convert_tokens_to_ids(eot)
    ends = [i for i, (m, nxt) in enumerate(zip(sample.loss_mask, sample.loss_mask[1:] + [False])) if m and not nxt]
    assert [sample.input_ids[i] for i in ends] == [eot_id, eot_id]
    rendered = tok.apply_chat_template(record["messages"], tokenize=False, chat_template=template, **kwargs)
    assert tok.decode(sample.input_ids, skip_special_tokens=False) == rendered


def test_record_formats_give_the_same_sample():
    tok = smollm2_tokenizer()
    cfg = ChatConfig()
    messages = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]}
    pair = {"prompt": "Name a colour.", "response": "Blue."}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
                          {"role": "assistant", "content": "Blue."}]}
    samples = [encode_record(r, tok, cfg) for r in (messages, sharegpt, pair, parts)]
    assert all(s.input_ids == samples[0].input_ids and s.loss_mask == samples[0].loss_mask for s in samples)
    assert supervised_runs(tok, samples[0]) == ["Blue.<|im_end|>"]
    text = encode_record({"text": "plain text here"}, tok, cfg)
    assert text.input_ids == tok("plain text here")["input_ids"] and all(text.loss_mask)


def test_leading_assistant_turns_are_dropped_and_counted():
    tok = smollm2_tokenizer()
    record = {"conversations": [{"from": "gpt", "value": "continued from before"}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Hello"}]}
    s = encode_record(record, tok, ChatConfig())
    assert s.dropped_leading_turns == 1
    assert supervised_runs(tok, s) == ["Hello<|im_end|>"]
    assert "continued" not in tok.decode(s.input_ids)


BAD = [
    ({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]}, "empty_content"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": ""}]}, "empty_content"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "bad \udcff byte"}, {"role": "assistant", "content": "y"}]},
     "not_utf8"),
    ({"question": "x", "answer": "y"}, "unknown_format"),
    (["not", "an", "object"], "unknown_format"),
]


@pytest.mark.parametrize("record,reason", BAD)
def test_bad_records_name_their_reason(record, reason):
    with pytest.raises(BadSample) as e:
        encode_record(record, smollm2_tokenizer(), ChatConfig())
    assert e.value.reason == reason


def test_over_long_samples_truncate_or_drop():
    tok = smollm2_tokenizer()
    record = {"messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": "word " * 60}]}
    full = encode_record(record, tok, ChatConfig())
    cut = encode_record(record, tok, ChatConfig(max_length=40))
    assert cut.truncated and cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]
    with pytest.raises(BadSample, match="--max-length") as e:
        encode_record(record, tok, ChatConfig(max_length=40, overlong="drop"))
    assert e.value.reason == "too_long"
    with pytest.raises(BadSample) as e:  # truncation leaving no assistant token is over-long too
        encode_record(record, tok, ChatConfig(max_length=full.loss_mask.index(True)))
    assert e.value.reason == "too_long"


def test_template_refusing_a_conversation_is_a_bad_record():
    record = _conv("a", "b", system="no system role in gemma")
    with pytest.raises(BadSample, match="System role not supported") as e:
        encode_record(record, family_tokenizer(), ChatConfig(chat_template=GEMMA))
    assert e.value.reason == "template_error"


def test_templates_that_cannot_mark_assistant_spans_fail_clearly():
    tok = family_tokenizer()
    with pytest.raises(TemplateError, match="no end-of-turn special token"):
        check_template(tok, ChatConfig(chat_template=PLAIN))
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(NoChatTemplate, match="--chat-template"):
        check_template(bare, ChatConfig())


def test_hashes_tell_tokenizers_and_templates_apart():
    tok, fam = smollm2_tokenizer(), family_tokenizer()
    assert tokenizer_hash(tok) == tokenizer_hash(copy.deepcopy(tok)) != tokenizer_hash(fam)
    assert chat_template_hash(tok) != chat_template_hash(tok, ChatConfig(chat_template=QWEN3))
    assert end_of_turn_token(fam, ChatConfig(chat_template=LLAMA3)) == "<|eot_id|>"
