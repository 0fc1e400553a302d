"""Evaluation prompts: the opening turns of each record, rendered as training renders them.

Design choices:
- Records come from dflashkit.extract.data.sources (builtin:mtbench, builtin:humaneval, builtin:sharegpt, .jsonl /
  .json / .parquet files), so eval and extraction read data the same way.
- A prompt is everything up to and including the first user turn (system turns before it kept); answers in
  the record are dropped: the target writes its own. MT-bench contributes its first turn.
- A record's turns are read by the one renderer (extract/data/rendering.py ``normalize_record``): the same role
  aliases, content rules and leading assistant turns dropped as for training; a record training would skip for
  its turns (a role it does not know, an empty turn) is skipped and counted here too. Records with only
  "text", "prompt" or "question" are used as a single user turn.
- The prompt's tokens are ``rendering.prompt_ids``: the chat template (the run's template and kwargs,
  eval/chat_settings.py) with the generation prompt, tokenized without added special tokens: the tokens a
  training sample holds before its first answer. A tokenizer without a template and no --chat-template is one
  line asking for one, as in training.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.extract.data.rendering import BadSample, ChatConfig, content_text, normalize_record, prompt_ids
from dflashkit.extract.data.sources import conversation_fields, prompt_turns


@dataclass
class Prompt:
    dataset: str  # the --dataset spec it came from
    id: str  # record id (or file:line)
    messages: list[dict]  # the conversation up to the first user turn
    input_ids: list[int]  # rendered and tokenized


def conversation_turns(record) -> list[dict] | None:
    """Every turn of a ``messages`` / ``conversations`` / ``prompt`` + ``response`` record as training reads it
    ({role, content}, template roles; rendering.normalize_record); None for another format. BadSample for a
    record training skips for its turns."""
    if not isinstance(record, dict):
        raise BadSample("unknown_format", f"expected a JSON object, got {type(record).__name__}")
    if conversation_fields(record) is None and not ("prompt" in record and ("response" in record
                                                                            or "completion" in record)):
        return None
    return normalize_record(record, require_assistant=False)[1]


def opening_turns(record, where: str) -> list[dict]:
    """System turns and the first user turn of a record (``prompt_turns``, the one definition extraction's data
    code holds); BadSample for a record training skips for its turns."""
    turns = conversation_turns(record)
    if turns is not None:
        opening = prompt_turns(turns)
        if not opening:
            raise UserError(f"{where}: the record has no user turn in its "
                            f"{(conversation_fields(record) or ('prompt',))[0]!r}")
        return opening
    for key in ("prompt", "text", "question"):
        if isinstance(record.get(key), str):
            return [{"role": "user", "content": content_text(record[key], key)}]
    raise UserError(f"{where}: no 'messages', 'conversations', 'prompt' or 'text' field to take a prompt from")


def load_prompts(spec: str, tokenizer, num_prompts: int | None = None, max_prompt_tokens: int | None = None,
                 chat: ChatConfig | None = None, warn=None) -> list[Prompt]:
    """The first num_prompts usable prompts of a dataset spec, rendered with ``chat`` (None: the tokenizer's
    template, no kwargs); records that cannot be read or that training would skip are skipped, and ``warn``
    (default: stderr) is told how many, by reason."""
    from dflashkit.extract.data.sources import iter_records

    chat = chat or ChatConfig()
    prompts, skipped = [], {}
    for item in iter_records(spec):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        try:
            if item.record is None:
                raise BadSample(*item.bad)
            messages = opening_turns(item.record, item.where)
            ids = prompt_ids(tokenizer, messages, chat)
        except BadSample as e:
            skipped[e.reason] = skipped.get(e.reason, 0) + 1
            continue
        if max_prompt_tokens is not None:
            ids = ids[-max_prompt_tokens:]
        prompts.append(Prompt(spec, str(item.record.get("id", item.where)), messages, ids))
    if skipped:
        counts, n = ", ".join(f"{reason} {k}" for reason, k in sorted(skipped.items())), sum(skipped.values())
        (warn or (lambda line: print(line, file=sys.stderr)))(f"{spec}: skipped {n} record{'s' * (n != 1)} "
                                                              f"({counts}), as training skips them")
    if not prompts:
        raise UserError(f"{spec}: no usable prompt found")
    return prompts


def multi_turn_prompts(datasets: list[str], num_prompts: int) -> list[tuple[str, list[dict], str]]:
    """(id, opening turns, second user turn) of the records that have a second user turn (MT-bench does; so do
    ShareGPT ``conversations``), the turns read as every eval prompt is (eval/prompts.py)."""
    from dflashkit.extract.data.sources import iter_records

    out = []
    for spec in datasets:
        taken = 0
        for item in iter_records(spec):
            if taken >= num_prompts:
                break
            if item.record is None:
                continue
            try:
                turns = conversation_turns(item.record) or []
            except BadSample:  # skipped and not counted, as load_prompts skips it
                continue
            taken += 1
            users = [t["content"] for t in turns if t["role"] == "user"]
            if len(users) >= 2:
                out.append((f"{spec}#{item.record.get('id', item.where)}", prompt_turns(turns), users[1]))
    return out


def target_stop_ids(target_dir: Path, tokenizer, chat: ChatConfig | None = None) -> list[int]:
    """The ids an answer ends on (targets/chat_template.stop_token_ids, as the default engine's and
    regeneration's), with the generation config of ``target_dir`` read as transformers reads it for the model."""
    from transformers import GenerationConfig

    from dflashkit.targets.chat_template import stop_token_ids

    generation = (GenerationConfig.from_pretrained(target_dir)
                  if (Path(target_dir) / "generation_config.json").is_file() else None)
    chat = chat or ChatConfig()
    return list(stop_token_ids(tokenizer, generation, chat.chat_template, chat.template_kwargs))
