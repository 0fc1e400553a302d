"""Chat records -> token ids and a loss mask over the assistant's tokens, on the renderer's spans
(extract/data/rendering.py: records -> messages, the template, the assistant spans).

Design choices:
- Four record formats: OpenAI ``messages`` [{role, content}], ShareGPT ``conversations`` [{from, value}],
  ``prompt``/``response`` (one exchange, optional ``system``), and plain ``text`` (every token supervised).
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

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from dflashkit.targets.chat_template import closing_token, special_tokens

from .rendering import (
    BadSample,
    ChatConfig,
    NoChatTemplate,
    TemplateError,
    assistant_spans,
    normalize_record,
)

PROBE_CONVERSATION = [{"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "2+2 is 4."},
                      {"role": "user", "content": "And 3+3?\n"},
                      {"role": "assistant", "content": "It is 6.\nAnything else?"}]


@dataclass
class EncodedSample:
    input_ids: list[int]  # token ids of the rendered conversation
    loss_mask: list[bool]  # True on the tokens the drafter learns (assistant turns incl. end-of-turn)
    truncated: bool = False  # cut to max_length
    dropped_leading_turns: int = 0  # assistant turns before the first user turn, removed


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
    probe_cfg = dataclasses.replace(cfg, max_length=None)  # the template is probed whole: the data's cut is not its
    try:
        ids, mask = encode_chat(tokenizer, PROBE_CONVERSATION, probe_cfg, specials)
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
