"""Evaluation prompts: the opening user turn of each record, rendered with the target's chat template.

Design choices:
- Records come from dflashkit.extract.data.sources (builtin:mtbench, builtin:humaneval, builtin:sharegpt, .jsonl /
  .json / .parquet files), so eval and extraction read data the same way.
- A prompt is everything up to and including the first user turn (system turns before it kept); answers in
  the record are dropped: the target writes its own. MT-bench contributes its first turn.
- Records with only "text" (or "prompt") are used as a single user turn.
- The chat template is applied with add_generation_prompt=True and the run's template kwargs through
  dflashkit.targets.chat_template.render_chat, the call extraction and training render with; the text is then
  tokenized without added special tokens, as extraction does. A tokenizer without a template gets the raw text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.extract.data.sources import ROLE_ALIASES, conversation_fields, prompt_turns


@dataclass
class Prompt:
    dataset: str  # the --dataset spec it came from
    id: str  # record id (or file:line)
    messages: list[dict]  # the conversation up to the first user turn
    input_ids: list[int]  # rendered and tokenized


def conversation_turns(record: dict) -> list[dict] | None:
    """Every turn of a ``messages`` / ``conversations`` record as {role, content} (template roles; a turn of an
    unknown role or shape is left out: eval needs only the user and system turns); None for another format."""
    fields = conversation_fields(record)
    if fields is None:
        return None
    key, role_key, text_key = fields
    turns = []
    for message in record[key] if isinstance(record[key], list) else []:
        role = ROLE_ALIASES.get(str(message.get(role_key, "")).lower()) if isinstance(message, dict) else None
        if role is not None:
            turns.append({"role": role, "content": str(message.get(text_key, ""))})
    return turns


def opening_turns(record: dict, where: str) -> list[dict]:
    """System turns and the first user turn of a record (``prompt_turns``, the one definition extraction's data
    code holds)."""
    turns = conversation_turns(record)
    if turns is not None:
        opening = prompt_turns(turns)
        if not opening:
            raise UserError(f"{where}: the record has no user turn in its {conversation_fields(record)[0]!r}")
        return opening
    for key in ("prompt", "text", "question"):
        if isinstance(record.get(key), str):
            return [{"role": "user", "content": record[key]}]
    raise UserError(f"{where}: no 'messages', 'conversations', 'prompt' or 'text' field to take a prompt from")


def render(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    from dflashkit.targets.chat_template import render_chat

    if getattr(tokenizer, "chat_template", None):
        text = render_chat(tokenizer, messages, add_generation_prompt=True, template_kwargs=template_kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]


def load_prompts(spec: str, tokenizer, num_prompts: int | None = None, max_prompt_tokens: int | None = None,
                 template_kwargs: dict | None = None) -> list[Prompt]:
    """The first num_prompts usable prompts of a dataset spec (bad records are skipped)."""
    from dflashkit.extract.data.sources import iter_records

    prompts = []
    for item in iter_records(spec):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        if item.record is None:
            continue
        messages = opening_turns(item.record, item.where)
        ids = render(tokenizer, messages, template_kwargs)
        if max_prompt_tokens is not None:
            ids = ids[-max_prompt_tokens:]
        prompts.append(Prompt(spec, str(item.record.get("id", item.where)), messages, ids))
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
            taken += 1
            users = [t["content"] for t in conversation_turns(item.record) or [] if t["role"] == "user"]
            if len(users) >= 2:
                out.append((f"{spec}#{item.record.get('id', item.where)}", opening_turns(item.record, item.where),
                            users[1]))
    return out


def target_stop_ids(target_dir: Path, tokenizer, template_kwargs: dict | None = None) -> list[int]:
    """The ids an answer ends on (targets/chat_template.stop_token_ids, as the default engine's and
    regeneration's), with the generation config of ``target_dir`` read as transformers reads it for the model."""
    from transformers import GenerationConfig

    from dflashkit.targets.chat_template import stop_token_ids

    generation = (GenerationConfig.from_pretrained(target_dir)
                  if (Path(target_dir) / "generation_config.json").is_file() else None)
    return list(stop_token_ids(tokenizer, generation, template_kwargs=template_kwargs))
