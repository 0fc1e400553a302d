"""Reading a recipe: a YAML file of TrainConfig fields, then ``key=value`` overrides, into one TrainConfig.

Design choices:
- A recipe is a flat YAML mapping whose keys are TrainConfig's fields (train/config.py); an unknown key is an
  error that names the key and the recipe file, with the closest field when one is near ("did you mean"). A key
  given twice in one mapping is refused naming both lines: YAML would keep the last value silently.
- Everything is checked when it is read, before anything loads: YAML that does not parse (the line), a value of
  the wrong type (an int field takes 4, not 4.7 or true; floats are finite; lists and mappings are YAML's), and
  ``drafter:``'s keys and values against DrafterConfig; the message names the recipe file and the field.
- Overrides on the command line use the same names (``lr=3e-4 loss=dpace``); values are parsed as YAML
  (numbers, booleans, lists ``[1,2]``, ``null``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path

from dflashkit.errors import UserError, shown

from .config import TrainConfig, check_drafter_fields


def parse_override(item: str) -> tuple[str, object]:
    import yaml

    if "=" not in item:
        raise UserError(f"override {shown(item)}: expected key=value (e.g. lr=3e-4)")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-").replace("-", "_")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise UserError(f"override {shown(item)}: the value is not YAML ({getattr(e, 'problem', None) or e}); quote "
                        f"it, e.g. {key}='\"{raw}\"'") from None
    return key, value


def _did_you_mean(unknown: list[str], known: set[str]) -> str:
    """`` (did you mean 'block_size'?)`` for a misspelt field name (the first that is close to a known one)."""
    for name in unknown:
        close = difflib.get_close_matches(name[:200], sorted(known), n=1, cutoff=0.75)
        if close:
            return f" (did you mean {close[0]!r} for {shown(name)}?)" if len(unknown) > 1 else \
                f" (did you mean {close[0]!r}?)"
    return ""


def _key_given_twice(node) -> tuple[str, int, int] | None:
    """(key, its second line, its first line) of the first key given twice in one mapping of a composed YAML
    document (nested mappings such as ``drafter:`` included); None when every key is given once."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name is not None and name in seen:
                return name, key.start_mark.line + 1, seen[name]
            seen.setdefault(name, key.start_mark.line + 1)
            found = _key_given_twice(value)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        return next(filter(None, map(_key_given_twice, node.value)), None)
    return None


def read_recipe(recipe: str) -> dict:
    """A recipe file's fields; a missing file, YAML that does not parse, or anything but a mapping of known
    fields is refused naming the file (and the line), before anything loads."""
    import yaml

    path = Path(recipe)
    if not path.is_file():
        raise UserError(f"recipe {recipe}: no such file (see recipes/*.yaml)")
    try:
        text = path.read_text(encoding="utf-8-sig")
        data = yaml.safe_load(text) or {}
        twice = _key_given_twice(yaml.compose(text, Loader=yaml.SafeLoader))
    except UnicodeDecodeError as e:
        raise UserError(f"{recipe}: not UTF-8 text ({e.reason} at byte {e.start}); save the recipe as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise UserError(f"{recipe}: not valid YAML ({where}{getattr(e, 'problem', None) or e}); fix that line (a "
                        f"recipe is a mapping of TrainConfig fields, `lr: 6e-4`)") from None
    if twice is not None:  # YAML keeps the last value silently: the first would be a setting that never acts
        raise UserError(f"{recipe}: line {twice[1]}: {shown(twice[0])} is given again (line {twice[2]} gave it "
                        "first); keep one of the two")
    if not isinstance(data, dict):
        raise UserError(f"{recipe}: a recipe is a mapping of TrainConfig fields (`lr: 6e-4` per line), not a "
                        f"{type(data).__name__}")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise UserError(f"{recipe}: unknown field(s) {', '.join(map(shown, unknown))}{_did_you_mean(unknown, known)}"
                        f"; the fields are listed in train/config.py")
    return data


def coerce(value, kind: str, name: str):
    """``value`` as a TrainConfig field of type ``kind`` (YAML reads 6e-4 as a string; an int field takes 4 but
    not 4.7 or true); UserError naming the field when it is not one."""
    if kind == "int | str":  # a count or a word (tokenize_workers: 4 or auto)
        if value == "auto":
            return value
        try:
            return coerce(value, "int", name)
        except UserError:
            raise UserError(f"{name}: {shown(value)} is neither auto nor a whole number") from None
    if kind == "str" and isinstance(value, bool):  # YAML 1.1 reads an unquoted no / yes as a boolean
        return "no" if value is False else "yes"
    if kind == "str":
        if isinstance(value, (list, dict)):
            raise UserError(f"{name}: {shown(value)} is not a string")
        return str(value)  # a run_name of 2024 is YAML's number
    if kind == "bool":
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        raise UserError(f"{name}: {shown(value)} is not a boolean; use true or false")
    if kind in ("list", "dict"):
        if kind == "list" and isinstance(value, tuple):
            return list(value)
        if name == "data" and isinstance(value, str) or isinstance(value, list if kind == "list" else dict):
            return value
        example = "[1, 9, 17]" if kind == "list" else "{key: value}"
        raise UserError(f"{name}: {shown(value)} is not a {kind}; write it as YAML, e.g. {name}={example}")
    noun = "a float" if kind == "float" else "an int"
    if kind in ("int", "int | None", "float") and isinstance(value, bool):
        raise UserError(f"{name}: {shown(value)} is not {noun}")
    try:
        if kind == "float":
            number = float(value)
            if not math.isfinite(number):
                raise UserError(f"{name}: {shown(value)} is not a finite number")
            return number
        if kind in ("int", "int | None"):
            number = float(value) if isinstance(value, (float, str)) else value
            if isinstance(number, float) and not number.is_integer():
                raise UserError(f"{name}: {shown(value)} is not a whole number")
            return int(number)
    except (TypeError, OverflowError):
        raise UserError(f"{name}: {shown(value)} is not {noun}") from None
    except ValueError as e:
        if str(e).startswith(f"{name}: "):
            raise
        raise UserError(f"{name}: {shown(value)} is not {noun}") from None
    return value


def load_config(recipe: str | None = None, overrides: list[str] | tuple = (), **kwargs) -> TrainConfig:
    """Recipe YAML, then ``key=value`` overrides, then keyword arguments (tests). A bad value read from the
    recipe is refused naming the recipe file too."""
    values: dict = {}
    origin: dict = {}  # field -> the recipe file it was read from (named in errors)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    if recipe:
        values.update(read_recipe(recipe))
        origin = dict.fromkeys(values, recipe)
    for item in overrides:
        key, value = parse_override(item)
        if key not in known:
            raise UserError(f"override {shown(item)}: unknown field {shown(key)}{_did_you_mean([key], known)}; "
                            f"the fields are listed in train/config.py")
        values[key] = value
        origin.pop(key, None)
    values.update(kwargs)
    for key in kwargs:
        origin.pop(key, None)
    for f in dataclasses.fields(TrainConfig):
        if values.get(f.name) is None:
            continue
        prefix = f"{origin[f.name]}: " if f.name in origin else ""
        try:
            values[f.name] = coerce(values[f.name], str(f.type), f.name)
            if f.name == "drafter":
                check_drafter_fields(values["drafter"], values.get("drafter_architecture", "dflash"))
        except UserError as e:  # named with the recipe file the value came from
            raise UserError(f"{prefix}{e}") from None
    return TrainConfig(**values)
