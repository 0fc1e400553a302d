"""The one prompt renderer: a chat record -> its messages -> the chat template's text, a prompt's token ids and
the character spans of the assistant turns. Extraction, online training, regeneration, eval and the benchmarks
all render here (extract/data/chat.py builds a training sample's ids and loss mask on these spans), so a prompt
is the same tokens wherever it is made.

Design choices:
- One rule for roles: a message's role must be one of ``sources.ROLE_ALIASES``; any other role makes the whole
  record bad (``BadSample("unknown_role")``), which training counts or refuses (``--on-bad``) and eval skips and
  counts. No turn is left out silently: a conversation without one of its turns is not the conversation.
- One rule for templates: the tokenizer's own, or ``ChatConfig.chat_template`` (the text of a ``--chat-template``
  file) in its place, always with ``ChatConfig.template_kwargs``. A chat record and no template is a UserError
  (``NoChatTemplate``) wherever it is rendered; turns are never joined by another rule.
- A prompt (``prompt_ids``) is the template's text with the generation prompt, tokenized without added special
  tokens (the template writes any BOS itself): the tokens a training sample holds before that assistant turn.
- Assistant spans are found by rendering prefixes, never by per-family patterns: for assistant turn i its
  generation prompt (messages[:i] + the generation prompt) and its history (messages[:i + 1]). The supervised
  part of a turn is what the target itself would generate after the generation prompt, up to and including the
  end-of-turn token (the last special token of the turn). ChatML (SmolLM2), Llama 3, Qwen3 with thinking on and
  off, Gemma all take this one path.
- Some templates render a turn differently once later turns follow it (Qwen3 drops the reasoning of earlier
  turns, and its thinking-off generation prompt differs from the history header). Such a turn is located in
  the full rendering by its header (the part of the generation prompt the history shares) and its end-of-turn
  token.
- Cost: the conversation renders once; each assistant turn renders its prefixes, which grow with the turns
  before it. With ``max_length`` the turns stop once the tokens before the next one pass it (``_TokenCount``):
  that turn and all after it lie past the cut, so the sample is the same tokens, and a conversation of 10,000
  messages costs one rendering plus the turns within ``max_length``. Without ``max_length`` every turn is
  rendered (the sample holds them all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflashkit.errors import UserError, shown
from dflashkit.targets.chat_template import last_special, render_chat, special_tokens

from .sources import ROLE_ALIASES, conversation_fields

# every reason a sample can be skipped for; the manifest counts skips under these names
SKIP_REASONS = ("malformed_json", "not_utf8", "unknown_format", "unknown_role", "empty_content",
                "no_assistant_turn", "no_user_turn", "too_long", "template_error", "too_large")


class BadSample(Exception):
    """One record that cannot become a sample; ``reason`` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str, where: str = ""):
        assert reason in SKIP_REASONS, reason
        super().__init__(detail)
        self.reason, self.detail, self.where = reason, detail, where

    def __str__(self) -> str:
        return f"{self.where + ': ' if self.where else ''}{self.reason}: {self.detail}"


class TemplateError(UserError):
    """The chat template cannot mark assistant spans (fatal from check_template; one record's from encode_record)."""


class NoChatTemplate(TemplateError):
    """The tokenizer has no chat template and none was given."""


def read_chat_template(path: str | None, flag: str = "--chat-template") -> str | None:
    """The text of the Jinja file the user gave as ``flag`` (None when none was given); a file that is missing,
    unreadable or not UTF-8 is a UserError naming it, not a traceback."""
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise UserError(f"{flag} {path}: cannot be read ({reason}); give the path of a Jinja chat template file "
                        "(UTF-8 text)") from None


@dataclass
class ChatConfig:
    max_length: int | None = None  # longest sample in tokens; None: no limit
    overlong: str = "truncate"  # what to do with a longer sample: "truncate" it to max_length, or "drop" it
    template_kwargs: dict = field(default_factory=dict)  # extra template variables, e.g. {"enable_thinking": False}
    chat_template: str | None = None  # a Jinja template replacing the tokenizer's own; None: the tokenizer's

    def __post_init__(self):
        if self.overlong not in ("truncate", "drop"):
            raise ValueError(f"overlong must be 'truncate' or 'drop', got {self.overlong!r}")
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"max_length must be >= 2 tokens, got {self.max_length}")


# ---------------------------------------------------------------- records -> messages


def _check_utf8(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        detail = f"{what} holds bytes that are not UTF-8 ({e.reason} at character {e.start})"
        raise BadSample("not_utf8", detail) from None
    return text


def content_text(value, what: str) -> str:
    """A message's text: a string, or OpenAI text content parts joined; BadSample when empty or of another
    shape."""
    if isinstance(value, list):  # OpenAI content parts
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            raise BadSample("unknown_format", f"{what}: only text content parts are supported")
        value = "".join(p["text"] for p in value)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BadSample("empty_content", f"{what} is empty")
    if not isinstance(value, str):
        raise BadSample("unknown_format", f"{what} must be a string, got {type(value).__name__}")
    return _check_utf8(value, what)


def _message(raw, role_key: str, text_key: str, k: int) -> dict:
    if not isinstance(raw, dict) or role_key not in raw:
        raise BadSample("unknown_format", f"message {k} has no {role_key!r} field")
    role = ROLE_ALIASES.get(str(raw[role_key]).lower())
    if role is None:
        raise BadSample("unknown_role", f"message {k} has role {shown(raw[role_key])}; known roles: "
                                        f"{', '.join(sorted(ROLE_ALIASES))}")
    msg = {"role": role, "content": content_text(raw.get(text_key), f"message {k} ({role}) content")}
    if role == "assistant" and isinstance(raw.get("reasoning_content"), str):
        msg["reasoning_content"] = _check_utf8(raw["reasoning_content"], f"message {k} reasoning_content")
    return msg


def normalize_record(record, require_assistant: bool = True) -> tuple[str, object, int]:
    """A record -> ("chat", messages, dropped_leading_turns) or ("text", text, 0). Raises BadSample."""
    if not isinstance(record, dict):
        raise BadSample("unknown_format", f"expected a JSON object, got {type(record).__name__}")
    fields = conversation_fields(record)
    if fields is not None:
        key, role_key, text_key = fields
        raw = record[key]
        if not isinstance(raw, list):
            raise BadSample("unknown_format", f"field {key!r} must be a list of messages")
        messages = [_message(m, role_key, text_key, k) for k, m in enumerate(raw)]
    elif "prompt" in record and ("response" in record or "completion" in record):
        messages = ([{"role": "system", "content": content_text(record["system"], "system")}]
                    if record.get("system") else [])
        messages.append({"role": "user", "content": content_text(record["prompt"], "prompt")})
        answer = record["response"] if "response" in record else record["completion"]
        messages.append({"role": "assistant", "content": content_text(answer, "response")})
    elif "text" in record:
        return "text", content_text(record["text"], "text"), 0
    else:
        raise BadSample("unknown_format", "no 'messages', 'conversations', 'prompt'/'response' or 'text' field "
                                          f"(fields: {', '.join(shown(f, 40) for f in sorted(map(str, record))[:8])})")
    n_system = 0
    while n_system < len(messages) and messages[n_system]["role"] == "system":
        n_system += 1
    first = n_system
    while first < len(messages) and messages[first]["role"] == "assistant":
        first += 1
    messages = messages[:n_system] + messages[first:]
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadSample("no_assistant_turn", "the conversation has no assistant turn after a user turn")
    return "chat", messages, first - n_system


# ---------------------------------------------------------------- template rendering and prompts


def render(tokenizer, messages, cfg: ChatConfig, add_generation_prompt: bool = False) -> str:
    """The chat template's text for messages (BadSample when the template refuses them; NoChatTemplate when
    there is no template)."""
    try:
        return render_chat(tokenizer, messages, add_generation_prompt, cfg.chat_template, cfg.template_kwargs)
    except TemplateError:
        raise
    except Exception as e:  # jinja errors and raise_exception() of the template
        if "chat_template is not set" in str(e) or "no chat template" in str(e).lower():
            raise NoChatTemplate("the tokenizer has no chat template: pass --chat-template FILE (a Jinja "
                                 "template) or give records as plain 'text'") from None
        raise BadSample("template_error", f"the chat template refused the conversation: {shown(str(e), 200)}") from None


def prompt_ids(tokenizer, messages: list[dict], cfg: ChatConfig) -> list[int]:
    """The token ids that ask for the next assistant turn of ``messages``: their rendering with the generation
    prompt, tokenized without added special tokens, as a training sample holds them before that turn."""
    return tokenizer(render(tokenizer, messages, cfg, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- assistant spans


def _shared_header(prompt_tail: str, rest: str, specials: list[str]) -> str:
    """The part of the generation prompt that the turn's header in the history shares, cut at a boundary."""
    if rest.startswith(prompt_tail):
        return prompt_tail
    n = 0
    while n < min(len(prompt_tail), len(rest)) and prompt_tail[n] == rest[n]:
        n += 1
    common = prompt_tail[:n]
    cut = common.rfind("\n") + 1
    for s in specials:
        pos = common.rfind(s)
        if pos >= 0:
            cut = max(cut, pos + len(s))
    if cut == 0:
        raise TemplateError(f"cannot find the assistant header in the history (generation prompt {prompt_tail!r})")
    return common[:cut]


def _disagree(i: int) -> TemplateError:
    return TemplateError(f"turn {i} does not render as a continuation of the generation prompt before it "
                         "(prefix renderings disagree, e.g. reasoning under a thinking-off template)")


class _TokenCount:
    """The tokens of a sample's segments so far, counted only when they may exceed ``limit``: a segment
    of b UTF-8 bytes is taken to be at most b + 1 tokens until then (a tokenizer that makes more only makes
    the count come later; passing the limit is always decided on real tokens)."""

    def __init__(self, tokenizer, limit: int | None):
        self.tokenizer, self.limit = tokenizer, limit
        self.counted, self.pending, self.bound = 0, [], 0

    def add(self, text: str) -> None:
        if text and self.limit is not None:
            self.pending.append(text)
            self.bound += len(text.encode("utf-8")) + 1

    def reached(self) -> bool:
        """Whether the segments added hold more than ``limit`` tokens (so the sample is over-long, and cut or
        dropped, whatever follows)."""
        if self.limit is None or self.counted + self.bound <= self.limit:
            return False
        ids = self.tokenizer(self.pending, add_special_tokens=False)["input_ids"]
        self.counted += sum(map(len, ids))
        self.pending, self.bound = [], 0
        return self.counted > self.limit


def _turn_span(tokenizer, messages: list[dict], i: int, full: str, cfg: ChatConfig,
               specials: list[str]) -> tuple[int, int]:
    """The (start, end) characters of assistant turn i's supervised part in ``full``: two renderings (its
    generation prompt and its history; the last turn's history is ``full``), a third for a turn that later
    turns render differently."""
    prompt = render(tokenizer, messages[:i], cfg, add_generation_prompt=True)
    alone = full if i + 1 == len(messages) else render(tokenizer, messages[: i + 1], cfg)
    if not alone.startswith(prompt):
        raise _disagree(i)
    found = last_special(alone[len(prompt):], specials)
    if found is None:
        raise TemplateError(f"no end-of-turn special token after assistant turn {i}: the template "
                            f"renders it as {alone[len(prompt):][-80:]!r}")
    eot_pos, eot = found
    supervised = alone[len(prompt): len(prompt) + eot_pos + len(eot)]
    if full.startswith(prompt + supervised):  # the turn renders the same with later turns present
        return len(prompt), len(prompt) + len(supervised)
    before = render(tokenizer, messages[:i], cfg)  # e.g. Qwen3: earlier turns lose their reasoning / header
    if not (full.startswith(before) and prompt.startswith(before)):
        raise _disagree(i)
    start = len(before) + len(_shared_header(prompt[len(before):], full[len(before):], specials))
    k = full.find(eot, start)
    if k < 0:
        raise TemplateError(f"end-of-turn token {eot!r} of assistant turn {i} not found in the conversation")
    return start, k + len(eot)


def assistant_spans(tokenizer, messages: list[dict], cfg: ChatConfig,
                    specials: list[str] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the (start, end) character span of each supervised assistant turn.

    With ``cfg.max_length``, once the segments before the next assistant turn hold more than max_length tokens,
    that turn and the rest are not rendered: the text returned ends where the last span found ends (what follows
    lies past the cut), so the sample's first max_length tokens, and whether it is over-long, are those of the
    whole conversation."""
    specials = special_tokens(tokenizer) if specials is None else specials
    full = render(tokenizer, messages, cfg)
    spans: list[tuple[int, int]] = []
    count = _TokenCount(tokenizer, cfg.max_length)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if count.reached():  # this turn starts past max_length tokens: nothing of it is in the sample
            return full[: spans[-1][1]], spans
        start, end = _turn_span(tokenizer, messages, i, full, cfg, specials)
        if spans and start < spans[-1][1]:
            raise TemplateError(f"assistant turn {i} overlaps the previous one in the rendering")
        count.add(full[spans[-1][1] if spans else 0: start])
        count.add(full[start:end])
        spans.append((start, end))
    return full, spans
