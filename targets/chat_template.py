"""Rendering a conversation with the target's chat template: the one call extraction, training and eval share.

`template_kwargs` are extra template variables (e.g. {"enable_thinking": False} for Qwen3); a run must render
with the same ones its drafter was trained with, so every caller passes them through here.
"""

from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                chat_template: str | None = None, template_kwargs: dict | None = None) -> str:
    """The template's text for messages (chat_template: a Jinja template replacing the tokenizer's own)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **(template_kwargs or {}))
