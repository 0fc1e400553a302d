"""Chat records -> token ids and a loss mask over the assistant's tokens.

Design choices:
- Four record formats: OpenAI ``messages`` [{role, content}], ShareGPT ``conversations`` [{from, value}],
  ``prompt``/``response`` (one exchange, optional ``system``), and plain ``text`` (every token supervised).
- Conversations are rendered with the target tokenizer's own chat template. Assistant spans are found by
  rendering prefixes, never by per-family patterns: for assistant turn i we render messages[:i], the same with
  the generation prompt, and the conversation ending at turn i. The supervised part of a turn is what the target
  itself would generate after the generation prompt, up to and including the end-of-turn token (the last special
  token of the turn). ChatML (SmolLM2), Llama 3, Qwen3 with thinking on and off, Gemma all take this one path.
- Some templates render a turn differently once later turns follow it (Qwen3 drops the reasoning of earlier
  turns, and its thinking-off generation prompt differs from the history header). Such a turn is located in
  the full rendering by its header (the part of the generation prompt the history shares) and the end-of-turn
  token found above.
- Tokens are produced segment by segment (context, supervised, context, ...) with add_special_tokens=False:
  the split the target sees when it is prompted and then generates. Every supervised segment is checked:
  its tokens decode back to exactly its text, it ends with the end-of-turn token, and it contains the visible
  answer. ``check_template`` runs this on a probe conversation before any work, so a template that cannot mark
  assistant spans fails at once with a clear error.
- Leading assistant turns (ShareGPT splits long chats, so many pieces start with the model) have no prompt:
  they are dropped and counted, the rest of the conversation is kept.
- Bad records raise ``BadSample(reason, detail)``; the caller counts them by reason or fails (``--on-bad``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.targets.chat_template import closing_token, last_special, render_chat, special_tokens

from .sources import ROLE_ALIASES, conversation_fields

# every reason a sample can be skipped for; the manifest counts skips under these names
SKIP_REASONS = ("malformed_json", "not_utf8", "unknown_format", "unknown_role", "empty_content",
                "no_assistant_turn", "no_user_turn", "too_long", "template_error")
PROBE_CONVERSATION = [{"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "2+2 is 4."},
                      {"role": "user", "content": "And 3+3?\n"},
                      {"role": "assistant", "content": "It is 6.\nAnything else?"}]


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


@dataclass
class EncodedSample:
    input_ids: list[int]  # token ids of the rendered conversation
    loss_mask: list[bool]  # True on the tokens the drafter learns (assistant turns incl. end-of-turn)
    truncated: bool = False  # cut to max_length
    dropped_leading_turns: int = 0  # assistant turns before the first user turn, removed


# ---------------------------------------------------------------- records -> messages


def _check_utf8(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        detail = f"{what} holds bytes that are not UTF-8 ({e.reason} at character {e.start})"
        raise BadSample("not_utf8", detail) from None
    return text


def _content(value, what: str) -> str:
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
        raise BadSample("unknown_role", f"message {k} has role {raw[role_key]!r}; known roles: "
                                        f"{', '.join(sorted(ROLE_ALIASES))}")
    msg = {"role": role, "content": _content(raw.get(text_key), f"message {k} ({role}) content")}
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
        messages = [{"role": "system", "content": _content(record["system"], "system")}] if record.get("system") else []
        messages.append({"role": "user", "content": _content(record["prompt"], "prompt")})
        answer = record["response"] if "response" in record else record["completion"]
        messages.append({"role": "assistant", "content": _content(answer, "response")})
    elif "text" in record:
        return "text", _content(record["text"], "text"), 0
    else:
        raise BadSample("unknown_format", "no 'messages', 'conversations', 'prompt'/'response' or 'text' field "
                                          f"(fields: {', '.join(sorted(map(str, record))[:8])})")
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


# ---------------------------------------------------------------- template rendering and spans


def render(tokenizer, messages, cfg: ChatConfig, add_generation_prompt: bool = False) -> str:
    """The chat template's text for messages (BadSample when the template refuses them)."""
    try:
        return render_chat(tokenizer, messages, add_generation_prompt, cfg.chat_template, cfg.template_kwargs)
    except TemplateError:
        raise
    except Exception as e:  # jinja errors and raise_exception() of the template
        if "chat_template is not set" in str(e) or "no chat template" in str(e).lower():
            raise NoChatTemplate("the tokenizer has no chat template: pass --chat-template FILE (a Jinja "
                                "template) or give records as plain 'text'") from None
        raise BadSample("template_error", f"the chat template refused the conversation: {e}") from None


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


def assistant_spans(tokenizer, messages: list[dict], cfg: ChatConfig,
                    specials: list[str] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the (start, end) character span of each supervised assistant turn.

    Each turn costs two renderings, its generation prompt and the history up to it (the last turn's history is the
    conversation itself); the history before the prompt is rendered only for a turn that later turns change."""
    specials = special_tokens(tokenizer) if specials is None else specials
    full = render(tokenizer, messages, cfg)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
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
            start = len(prompt)
            end = start + len(supervised)
        else:  # e.g. Qwen3: earlier turns lose their reasoning / the thinking-off header
            before = render(tokenizer, messages[:i], cfg)
            if not (full.startswith(before) and prompt.startswith(before)):
                raise _disagree(i)
            start = len(before) + len(_shared_header(prompt[len(before):], full[len(before):], specials))
            k = full.find(eot, start)
            if k < 0:
                raise TemplateError(f"end-of-turn token {eot!r} of assistant turn {i} not found in the conversation")
            end = k + len(eot)
        if spans and start < spans[-1][1]:
            raise TemplateError(f"assistant turn {i} overlaps the previous one in the rendering")
        spans.append((start, end))
    return full, spans


# ---------------------------------------------------------------- encoding


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _decode_many(tokenizer, seqs: list[list[int]]) -> list[str]:
    """``_decode`` of each sequence; a plain fast tokenizer's (whose ``decode`` is its Rust decode, with no
    clean-up asked) decodes them in one Rust call."""
    if not seqs:
        return []
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: one sequence at a time
        TokenizersBackend = None
    cls = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and cls.decode is TokenizersBackend.decode and cls._decode is TokenizersBackend._decode):
        return tokenizer.backend_tokenizer.decode_batch(seqs, skip_special_tokens=False)
    return [_decode(tokenizer, ids) for ids in seqs]


def _visible_answer(message: dict) -> str:
    return message["content"].split("</think>")[-1].strip()


def _chat_pieces(tokenizer, messages: list[dict], cfg: ChatConfig, specials: list[str]):
    """The rendered conversation cut into segments: (texts, supervised flags)."""
    full, spans = assistant_spans(tokenizer, messages, cfg, specials)
    pieces, flags, pos = [], [], 0
    for start, end in spans:
        if start > pos:
            pieces.append(full[pos:start]), flags.append(False)
        pieces.append(full[start:end]), flags.append(True)
        pos = end
    if pos < len(full):
        pieces.append(full[pos:]), flags.append(False)
    return pieces, flags


def _join_pieces(messages: list[dict], pieces: list[str], flags: list[bool], toks: list[list[int]],
                 decoded: list[str]):
    """(input_ids, loss_mask) of the segments' tokens; ``decoded``: the supervised segments' tokens decoded, in
    order. Raises BadSample("template_error") when a supervised segment fails a check."""
    assistants = [m for m in messages if m["role"] == "assistant"]
    ids, mask, turn = [], [], 0
    for text, supervised, seg in zip(pieces, flags, toks):
        if supervised:
            if decoded[turn] != text:
                raise BadSample("template_error", f"assistant turn {turn}: its tokens do not decode back to its text")
            if _visible_answer(assistants[turn]) not in text:
                raise BadSample("template_error", f"assistant turn {turn}: its text was not found in the span "
                                                  f"the template marks ({text[:60]!r}...)")
            turn += 1
        ids.extend(seg)
        mask.extend([supervised] * len(seg))
    return ids, mask


def encode_chat(tokenizer, messages: list[dict], cfg: ChatConfig, specials: list[str] | None = None):
    """Messages -> (input_ids, loss_mask). Raises BadSample("template_error") when a check fails."""
    specials = special_tokens(tokenizer) if specials is None else specials
    pieces, flags = _chat_pieces(tokenizer, messages, cfg, specials)
    toks = _encode(tokenizer, pieces)
    return _join_pieces(messages, pieces, flags, toks, _decode_many(tokenizer, [t for t, f in zip(toks, flags) if f]))


def _finish(ids: list[int], mask: list[bool], dropped: int, cfg: ChatConfig) -> EncodedSample:
    """The sample of a record's tokens: cut or refused past ``max_length``; BadSample without a supervised token
    after the first position."""
    truncated = False
    if cfg.max_length is not None and len(ids) > cfg.max_length:
        if cfg.overlong == "drop":
            raise BadSample("too_long", f"{len(ids)} tokens > --max-length {cfg.max_length} (--overlong drop)")
        ids, mask, truncated = ids[: cfg.max_length], mask[: cfg.max_length], True
        if not any(mask[1:]):
            raise BadSample("too_long", f"no assistant token within the first {cfg.max_length} tokens")
    if not any(mask[1:]):
        raise BadSample("no_assistant_turn", "no supervised token after the first position")
    return EncodedSample(ids, mask, truncated, dropped)


def encode_records(records: list, tokenizer, cfg: ChatConfig,
                   specials: list[str] | None = None) -> list[EncodedSample | BadSample]:
    """Records -> for each, its EncodedSample or the BadSample it is skipped for (as ``encode_record``, which is
    this for one record). Each record is rendered alone; the segments of all of them are then tokenized in one
    tokenizer call and the supervised ones decoded back in one (a fast tokenizer spreads a batch over its
    threads: the data step took 1.66x less time inline on 2 cores). Raises TemplateError when
    there is no chat template."""
    specials = special_tokens(tokenizer) if specials is None else specials
    plans: list = []  # per record: a BadSample, or (kind, payload, dropped, pieces, flags)
    for record in records:
        try:
            kind, payload, dropped = normalize_record(record)
            if kind == "text":
                plans.append((kind, payload, dropped, [payload], None))
                continue
            try:
                pieces, flags = _chat_pieces(tokenizer, payload, cfg, specials)
            except NoChatTemplate:
                raise
            except TemplateError as e:
                raise BadSample("template_error", str(e)) from None
            plans.append((kind, payload, dropped, pieces, flags))
        except BadSample as e:
            plans.append(e)
    live = [p for p in plans if not isinstance(p, BadSample)]
    chat = iter(_encode(tokenizer, [t for p in live if p[0] != "text" for t in p[3]]))
    texts = [p[1] for p in live if p[0] == "text"]
    text_ids = iter(tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else [])
    toks = [next(text_ids) if p[0] == "text" else [next(chat) for _ in p[3]] for p in live]
    decoded = iter(_decode_many(tokenizer, [seg for p, t in zip(live, toks) if p[0] != "text"
                                            for seg, f in zip(t, p[4]) if f]))
    out, done = [], iter(zip(live, toks))
    for plan in plans:
        if isinstance(plan, BadSample):
            out.append(plan)
            continue
        (kind, payload, dropped, pieces, flags), seg = next(done)
        mine = [] if kind == "text" else [next(decoded) for f in flags if f]  # taken before any check can fail
        try:
            if kind == "text":
                ids, mask = list(seg), [True] * len(seg)
            else:
                ids, mask = _join_pieces(payload, pieces, flags, seg, mine)
            out.append(_finish(ids, mask, dropped, cfg))
        except BadSample as e:
            out.append(e)
    return out


def encode_record(record, tokenizer, cfg: ChatConfig, specials: list[str] | None = None) -> EncodedSample:
    """One record -> EncodedSample. Raises BadSample (counted or fatal per --on-bad) or TemplateError (fatal)."""
    result = encode_records([record], tokenizer, cfg, specials)[0]
    if isinstance(result, BadSample):
        raise result
    return result


def check_template(tokenizer, cfg: ChatConfig) -> str:
    """Fail before any work when the template cannot mark assistant spans; returns the end-of-turn token."""
    specials = special_tokens(tokenizer)
    try:
        ids, mask = encode_chat(tokenizer, PROBE_CONVERSATION, cfg, specials)
    except NoChatTemplate:
        raise
    except (BadSample, TemplateError) as e:
        detail = e.detail if isinstance(e, BadSample) else str(e)
        raise TemplateError(f"the chat template cannot mark assistant spans on a probe conversation: {detail}; "
                            "pass --chat-template FILE with a template that renders each turn as a continuation") from e
    runs, prev = [], False
    for k, m in enumerate(mask):
        if m and not prev:
            runs.append([k, k + 1])
        elif m:
            runs[-1][1] = k + 1
        prev = m
    if len(runs) != 2:
        raise TemplateError(f"the chat template marks {len(runs)} assistant spans on a two-turn probe conversation")
    return end_of_turn_token(tokenizer, cfg, specials)


def end_of_turn_token(tokenizer, cfg: ChatConfig, specials: list[str] | None = None) -> str:
    """The special token that closes an assistant turn under this template (targets/chat_template.closing_token,
    the rule stop_token_ids ends answers with); TemplateError when there is none."""
    found = closing_token(tokenizer, cfg.chat_template, cfg.template_kwargs, specials)
    if found is None:
        raise TemplateError("the chat template closes an assistant turn with no special token")
    return found


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id) and the special tokens: equal hashes mean equal token ids."""
    payload = {"vocab": sorted(tokenizer.get_vocab().items()), "special": special_tokens(tokenizer)}
    return _sha256(json.dumps(payload, ensure_ascii=False))


def chat_template_hash(tokenizer, cfg: ChatConfig | None = None) -> str | None:
    """sha256 of the chat template in use (None: no template)."""
    template = (cfg.chat_template if cfg and cfg.chat_template else None) or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return _sha256(template) if template else None
