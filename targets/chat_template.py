"""Rendering a conversation with the target's chat template, and the tokens an answer ends on: the one definition
extraction, regeneration, training and eval share.

`template_kwargs` are extra template variables (e.g. {"enable_thinking": False} for Qwen3); a run must render
with the same ones its drafter was trained with, so every caller passes them through here.

Stop tokens (``stop_token_ids``): an answer ends on any of the generation config's eos ids, the tokenizer's eos
and, for a tokenizer with a chat template, the special token that closes an assistant turn under that template
(``closing_token``: found by rendering a probe exchange, never by per-family lists). Regeneration writes answers
and eval decodes them with this one set, so both end an answer on the same token.
"""

from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                chat_template: str | None = None, template_kwargs: dict | None = None) -> str:
    """The template's text for messages (chat_template: a Jinja template replacing the tokenizer's own)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **(template_kwargs or {}))


# a user turn and its answer: what the template adds for the answer shows how it closes an assistant turn
PROBE_EXCHANGE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."}]


def special_tokens(tokenizer) -> list[str]:
    """Text of every special token (end-of-turn candidates), longest first."""
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content if hasattr(tok, "content") else tok))
    return sorted((t for t in out if t), key=lambda t: (-len(t), t))


def last_special(text: str, specials: list[str]) -> tuple[int, str] | None:
    """(position, token) of the special token that starts last in text (longest wins a tie)."""
    best = None
    for s in specials:  # longest first, so a strict '>' keeps the longest at equal positions
        pos = text.rfind(s)
        if pos >= 0 and (best is None or pos > best[0]):
            best = (pos, s)
    return best


def closing_token(tokenizer, chat_template: str | None = None, template_kwargs: dict | None = None,
                  specials: list[str] | None = None) -> str | None:
    """The special token that closes an assistant turn under the template (chat_template: one replacing the
    tokenizer's own): the last special token of what the answer adds after the generation prompt; None when the
    template closes the turn with no special token."""
    specials = special_tokens(tokenizer) if specials is None else specials
    prompt = render_chat(tokenizer, PROBE_EXCHANGE[:1], True, chat_template, template_kwargs)
    exchange = render_chat(tokenizer, PROBE_EXCHANGE, False, chat_template, template_kwargs)
    found = last_special(exchange[len(prompt):], specials)
    return None if found is None else found[1]


def stop_token_ids(tokenizer, generation_config=None, chat_template: str | None = None,
                   template_kwargs: dict | None = None) -> tuple[int, ...]:
    """The token ids an answer ends on (module docstring), sorted: the eos ids of ``generation_config`` (the
    target's transformers GenerationConfig, ``model.generation_config``; None: it has none), the tokenizer's eos
    and, when a chat template is in use, the token that closes an assistant turn under it."""
    ids = set()
    for value in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        ids.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    if chat_template or getattr(tokenizer, "chat_template", None):
        closing = closing_token(tokenizer, chat_template, template_kwargs)
        if closing is not None:
            ids.add(tokenizer.convert_tokens_to_ids(closing))
    return tuple(sorted(int(i) for i in ids if i is not None))
