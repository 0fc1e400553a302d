"""Which chat template and template kwargs eval renders its prompts with.

Design choices:
- A drafter learns the tokens its training rendered, so eval renders as the drafter was trained unless told
  otherwise: ``--chat-template FILE`` / ``--chat-template-kwargs JSON`` when given, else what the drafter's
  config.json records (``chat_template``: the Jinja text training rendered with, null for the target tokenizer's
  own; ``chat_template_kwargs``; both written by the export, drafter/export.py), else the target tokenizer's own
  template and no kwargs. Each of the two is resolved alone.
- The prompts are rendered by extract/data/rendering.py, the renderer training used, with these settings.
- ``describe`` is the line the run starts with and the report keeps: where each setting came from, and the
  template's sha256 (the chat-template hash an extraction manifest records).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.extract.data.rendering import ChatConfig, read_chat_template


@dataclass
class EvalChat:
    config: ChatConfig  # what the prompts are rendered with (chat_template None: the target tokenizer's own)
    template_from: str  # where the template came from: "--chat-template FILE", "DRAFTER/config.json", "the target"
    kwargs_from: str  # where the kwargs came from: "--chat-template-kwargs", "DRAFTER/config.json", "default"
    trained: dict  # what the drafter's config.json records (keys chat_template / chat_template_kwargs, if any)

    def template_sha256(self) -> str | None:
        """sha256 of the template given (None: the target tokenizer's own)."""
        text = self.config.chat_template
        return hashlib.sha256(text.encode("utf-8")).hexdigest() if text is not None else None

    def record(self) -> dict:
        """What a report keeps of the settings."""
        return {"chat_template_sha256": self.template_sha256(), "chat_template_from": self.template_from,
                "chat_template_kwargs": dict(self.config.template_kwargs),
                "chat_template_kwargs_from": self.kwargs_from}


def trained_chat(drafter_dir: str | Path) -> dict:
    """The chat settings the drafter's config.json records: ``chat_template`` (text, or None for the target's
    own) and ``chat_template_kwargs``, each only when recorded; a field of the wrong type is a UserError."""
    config = Path(drafter_dir) / "config.json"
    if not config.is_file():
        return {}
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # the drafter loader names a damaged config.json
    out = {k: data[k] for k in ("chat_template", "chat_template_kwargs") if k in data}
    if not isinstance(out.get("chat_template", ""), (str, type(None))):
        raise UserError(f"{config}: chat_template must be the template's text or null; export the drafter again")
    if not isinstance(out.get("chat_template_kwargs", {}), dict):
        raise UserError(f"{config}: chat_template_kwargs must be a JSON object; export the drafter again")
    return out


def resolve_chat(drafter_dir: str | Path, template_file: str | None, template_kwargs: dict | None) -> EvalChat:
    """The settings eval renders with (module docstring): ``template_file`` / ``template_kwargs`` (None: not
    given), else the drafter's recorded ones, else the target's template and no kwargs."""
    trained, where = trained_chat(drafter_dir), f"{drafter_dir}/config.json"
    if template_file:
        template, template_from = read_chat_template(template_file), f"--chat-template {template_file}"
    elif "chat_template" in trained:
        template, template_from = trained["chat_template"], where
    else:
        template, template_from = None, "the target"
    if template_kwargs is not None:
        kwargs, kwargs_from = dict(template_kwargs), "--chat-template-kwargs"
    elif "chat_template_kwargs" in trained:
        kwargs, kwargs_from = dict(trained["chat_template_kwargs"]), where
    else:
        kwargs, kwargs_from = {}, "default"
    return EvalChat(ChatConfig(template_kwargs=kwargs, chat_template=template), template_from, kwargs_from, trained)


def describe(chat: EvalChat) -> str:
    """One line: the template and kwargs the prompts are rendered with, and where each came from."""
    sha = chat.template_sha256()
    template = ("the target tokenizer's own" if sha is None else f"sha256 {sha[:12]}") + f" (from {chat.template_from})"
    return (f"prompts rendered with chat template {template}, kwargs {json.dumps(chat.config.template_kwargs)} "
            f"(from {chat.kwargs_from})")


def mismatch_warnings(chat: EvalChat, drafter_dir: str | Path) -> list[str]:
    """A warning for each setting given on the command line that differs from what the drafter records."""
    out, trained = [], chat.trained
    if "chat_template_kwargs" in trained and trained["chat_template_kwargs"] != chat.config.template_kwargs:
        out.append(f"warning: {drafter_dir}/config.json says the drafter was trained with chat template kwargs "
                   f"{json.dumps(trained['chat_template_kwargs'])}, this run renders with "
                   f"{json.dumps(chat.config.template_kwargs)}; pass --chat-template-kwargs to match")
    if "chat_template" in trained and trained["chat_template"] != chat.config.chat_template:
        out.append(f"warning: {drafter_dir}/config.json records another chat template than this run renders with "
                   f"({chat.template_from}); drop --chat-template to render as the drafter was trained")
    return out
