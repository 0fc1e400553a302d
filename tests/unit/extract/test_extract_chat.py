"""Chat data -> token ids + loss mask: for each template family, the supervised tokens decode to exactly the
assistant text plus the end-of-turn token; record formats; bad records by reason.

The SmolLM2 testbed tokenizer carries the ChatML template itself. The other families are small Jinja templates
written after the real ones (Llama 3.1, Qwen3 with its reasoning handling, Gemma 2), on top of the same
tokenizer with their special tokens added (tests/support/chat_templates.py, shared with other tests).
"""

import copy

import pytest

from dflashkit.extract.data.chat import (
    _decode,
    _decode_many,
    chat_template_hash,
    check_template,
    encode_record,
    encode_records,
    end_of_turn_token,
    tokenizer_hash,
)
from dflashkit.extract.data.rendering import BadSample, ChatConfig, NoChatTemplate, TemplateError

from support.chat_data import smollm2_tokenizer
from support.chat_templates import GEMMA, LLAMA3, PLAIN, QWEN3, family_tokenizer, supervised_runs


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


def _same(a, b) -> bool:  # two results of encode_records: equal samples, or the same skip
    if isinstance(a, BadSample) or isinstance(b, BadSample):
        return type(a) is type(b) and (a.reason, a.detail) == (b.reason, b.detail)
    return a == b


@pytest.mark.parametrize("family", ["chatml-smollm2", "qwen3-thinking"])
def test_records_encoded_together_are_each_as_alone(family):
    """One tokenizer call for a batch of records (good, truncated, plain text, dropped turns, every bad kind, in
    between): each record's sample or skip is the one it gets alone, in its place, and each good sample is the
    template's own rendering."""
    template, kwargs, first, _ = FAMILIES[family]
    tok = smollm2_tokenizer() if template is None else family_tokenizer()
    cfg = ChatConfig(chat_template=template, template_kwargs=kwargs, max_length=48)
    long = {"messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": "word " * 60}]}
    lead = {"conversations": [{"from": "gpt", "value": "before"}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello"}]}
    records = [first, BAD[0][0], long, {"text": "plain text here"}, lead, BAD[3][0], _conv("a", "b"), BAD[4][0],
               {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y " * 80}]}]
    together = encode_records(records, tok, cfg)
    alone = [encode_records([r], tok, cfg)[0] for r in records]
    assert len(together) == len(records) and all(_same(a, b) for a, b in zip(together, alone))
    kinds = [r.reason if isinstance(r, BadSample) else "ok" for r in together]
    assert kinds == ["ok", "unknown_role", "ok", "ok", "ok", "no_assistant_turn", "ok", "not_utf8", "ok"]
    assert together[2].truncated and len(together[2].input_ids) == 48 and together[4].dropped_leading_turns == 1
    for r, got in zip(records, together):
        if not isinstance(got, BadSample) and "messages" in r and not got.truncated:
            rendered = tok.apply_chat_template(r["messages"], tokenize=False, chat_template=template, **kwargs)
            assert tok.decode(got.input_ids, skip_special_tokens=False) == rendered


def test_supervised_segments_decode_in_one_call_as_one_by_one():
    """A plain fast tokenizer decodes the segments in one Rust call, with what its decode gives each; a
    tokenizer class with its own decode keeps it."""
    tok = smollm2_tokenizer()
    seqs = [tok("Hello <|im_end|> there", add_special_tokens=False)["input_ids"], [], tok(" é ∑ 🙂 x")["input_ids"]]
    assert _decode_many(tok, seqs) == [_decode(tok, s) for s in seqs] == ["Hello <|im_end|> there", "", " é ∑ 🙂 x"]

    class Shouting(type(tok)):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    loud = copy.deepcopy(tok)
    loud.__class__ = Shouting
    assert _decode_many(loud, seqs) == ["HELLO <|IM_END|> THERE", "", " É ∑ 🙂 X"]


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


@pytest.mark.parametrize("family, renders", [("chatml-smollm2", 4), ("qwen3-thinking", 5)])
def test_each_turn_costs_two_renderings_and_a_changed_one_a_third(family, renders):
    """The data step's cost is mostly the template's renderings: the conversation once, then per assistant turn
    its generation prompt and its history (the last turn's is the conversation itself). Only a turn that later
    turns render differently (Qwen3 drops the reasoning of earlier turns) also renders the history before it."""
    template, kwargs, record, expected = FAMILIES[family]
    tok = copy.deepcopy(family_tokenizer() if template else smollm2_tokenizer())
    calls = []
    real = tok.apply_chat_template

    def counted(messages, *args, **kw):
        calls.append(len(messages))
        return real(messages, *args, **kw)

    tok.apply_chat_template = counted
    sample = encode_record(record, tok, ChatConfig(chat_template=template, template_kwargs=kwargs))
    assert supervised_runs(tok, sample) == expected
    assert len(calls) == renders
