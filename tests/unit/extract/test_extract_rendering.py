"""The one renderer (extract/data/rendering.py): a long conversation costs its rendering plus the turns within
max_length, and the sample is the same tokens as the whole conversation's, cut."""

import copy

import pytest

from dflashkit.extract.data.chat import encode_record
from dflashkit.extract.data.rendering import BadSample, ChatConfig

from support.chat_data import smollm2_tokenizer
from support.chat_templates import QWEN3, family_tokenizer


def _long_conversation(n_messages: int) -> dict:
    turns = []
    for k in range(n_messages // 2):
        turns += [{"role": "user", "content": f"question {k}: what comes after {k}?"},
                  {"role": "assistant", "content": f"<think>\ncount\n</think>\n\n{k + 1} comes after {k}."}]
    return {"messages": turns}


class RenderBudget:
    """A real tokenizer whose chat-template renderings and tokenizer calls are counted; a rendering past
    ``max_messages`` messages in all fails at once (the quadratic renderer would take minutes to finish)."""

    def __init__(self, tokenizer, max_messages: int):
        self.tok = copy.deepcopy(tokenizer)
        self.rendered = self.renders = self.tokenizer_calls = 0
        render, call = self.tok.apply_chat_template, type(self.tok).__call__

        def counted_render(messages, *args, **kwargs):
            self.renders += 1
            self.rendered += len(messages)
            assert self.rendered <= max_messages, f"{self.rendered} messages rendered in {self.renders} renderings"
            return render(messages, *args, **kwargs)

        budget = self

        class Counted(type(self.tok)):
            def __call__(self, *args, **kwargs):
                budget.tokenizer_calls += 1
                return call(self, *args, **kwargs)

        self.tok.apply_chat_template = counted_render
        self.tok.__class__ = Counted


@pytest.mark.parametrize("template", [None, QWEN3])
def test_a_10000_message_conversation_renders_once_plus_the_turns_within_max_length(template):
    """Issue 71: each assistant turn rendered its whole history, so 10,000 messages took minutes under
    --max-length 256. Now the conversation renders once and the turns stop once the tokens before the next one
    pass max_length: the messages rendered grow with the conversation once, not with its square."""
    n = 10_000
    record = _long_conversation(n)
    budget = RenderBudget(family_tokenizer() if template else smollm2_tokenizer(), max_messages=n + 2_000)
    sample = encode_record(record, budget.tok, ChatConfig(max_length=256, chat_template=template))
    assert sample.truncated and len(sample.input_ids) == 256
    assert budget.rendered <= n + 2_000 and budget.tokenizer_calls <= 40
    # the same first 256 tokens as a conversation that ends well after the cut
    short = encode_record(_long_conversation(120), budget.tok, ChatConfig(max_length=256, chat_template=template))
    assert (short.input_ids, short.loss_mask) == (sample.input_ids, sample.loss_mask)


@pytest.mark.parametrize("template", [None, QWEN3])
@pytest.mark.parametrize("max_length", [2, 31, 57, 58, 59, 120, 400])
def test_stopping_at_max_length_gives_the_whole_conversation_cut(template, max_length):
    """Every max_length around turn boundaries: the sample (ids, mask, truncated) or the skip is the one the
    whole conversation's rendering gives, cut or dropped, under both over-long rules (Qwen3 renders earlier turns
    differently once later ones follow; the turns rendered are still those of the whole conversation)."""
    tok = family_tokenizer() if template else smollm2_tokenizer()
    record = _long_conversation(12)
    whole = encode_record(record, tok, ChatConfig(chat_template=template))
    for overlong in ("truncate", "drop"):
        cfg = ChatConfig(max_length=max_length, overlong=overlong, chat_template=template)
        over = len(whole.input_ids) > max_length
        if over and (overlong == "drop" or not any(whole.loss_mask[1:max_length])):
            with pytest.raises(BadSample) as e:
                encode_record(record, tok, cfg)
            assert e.value.reason == "too_long"
            continue
        got = encode_record(record, tok, cfg)
        assert got.truncated == over
        assert (got.input_ids, got.loss_mask) == (whole.input_ids[:max_length], whole.loss_mask[:max_length])
