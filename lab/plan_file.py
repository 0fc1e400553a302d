"""A lease plan read from YAML and resolved: the variables (the plan's ``vars``, a profile's, then ``--set``), every
``{placeholder}`` filled, the stages in the order their ``needs`` allow. lab/lease.py runs what this returns.

A plan's fields (lab/plans/*.yaml are the examples)::

    replaces: lab/testbed_engine026_lease.sh     # the shell script it stands for (documentation)
    run_dir: "{run}"                             # where the stages write; stages.jsonl and the logs go there
    vars: {run: /root/run026, levels: [1, 16]}   # a list spliced where an argv item is exactly "{levels}"
    profiles: {toy: {vars: {...}, skip_setup: true}}
    env: {TOKENIZERS_PARALLELISM: "false"}       # added to every stage's environment
    setup:                                       # the copy-in commands, each run by `lease setup PLAN NAME`
      - {name: testbed-a, brings: [.testbed/a], command: "mkdir -p ...", done: /root/testbed/a/part0}
    stages:
      - {name: train, argv: ["{python}", -m, dflashkit.train, ...], limit: 900, outputs: [train/run/summary.json],
         needs: [regenerate], gpu_idle: false, setup: [vllm24], optional: false}
    collect: ["*.log", "stages.jsonl", "compare/*.json"]

The built-in variables are ``root`` (the checkout), ``python`` (this interpreter unless the plan sets it) and
``run`` where the plan does not set it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflashkit.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
STAGE_KEYS = {"name", "argv", "limit", "outputs", "needs", "gpu_idle", "setup", "env", "grace", "optional"}


@dataclass
class Stage:
    name: str
    argv: list[str]
    limit: float
    outputs: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    gpu_idle: bool = False
    setup: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    grace: float = 30.0  # seconds between SIGINT at the limit and SIGKILL
    optional: bool = False  # runs only when --stages names it


@dataclass
class SetupStep:
    name: str
    command: str
    done: str
    brings: list[str] = field(default_factory=list)


@dataclass
class Plan:
    path: Path
    replaces: str
    run_dir: Path
    variables: dict
    env: dict[str, str]
    setup: list[SetupStep]
    stages: list[Stage]
    collect: list[str]
    skip_setup: bool


def parse_sets(pairs: list[str]) -> dict[str, str]:
    """``--set key=value`` pairs as a dict; a pair without '=' is a UserError."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set {pair!r}: write it as key=value (e.g. --set run=/root/run026)")
        out[key] = value
    return out


def _merge_vars(plan_vars: dict, overrides: dict, source: str) -> dict:
    """``plan_vars`` updated by ``overrides``; a --set of a list variable splits on spaces and commas."""
    merged = dict(plan_vars)
    for key, value in overrides.items():
        if source == "--set" and isinstance(plan_vars.get(key), list):
            value = [v for v in re.split(r"[\s,]+", value) if v]
        merged[key] = value
    return merged


def _fill(text: str, variables: dict, where: str, depth: int = 0) -> str:
    """``text`` with every {name} replaced by its variable (itself filled first); a list joins with spaces."""
    if depth > 20:
        raise UserError(f"{where}: placeholders refer to each other in a loop")

    def one(match: re.Match) -> str:
        name = match.group(1)
        if name not in variables:
            raise UserError(f"{where}: no variable {{{name}}}; add it to the plan's vars or pass --set {name}=...")
        value = variables[name]
        if isinstance(value, list):
            return " ".join(_fill(str(v), variables, where, depth + 1) for v in value)
        return _fill(str(value), variables, where, depth + 1)

    return PLACEHOLDER.sub(one, str(text))


def fill_argv(argv: list, variables: dict, where: str) -> list[str]:
    """Each item filled; an item that is exactly one placeholder of a list variable becomes that list's items."""
    out: list[str] = []
    for item in argv:
        match = PLACEHOLDER.fullmatch(str(item))
        if match and isinstance(variables.get(match.group(1)), list):
            out.extend(fill_argv(variables[match.group(1)], variables, where))
        else:
            out.append(_fill(item, variables, where))
    return out


def _stage(raw: dict, variables: dict, where: str) -> Stage:
    unknown = set(raw) - STAGE_KEYS
    if unknown or "name" not in raw or "argv" not in raw or "limit" not in raw:
        raise UserError(f"{where}: a stage needs name, argv and limit (and may have {sorted(STAGE_KEYS)}); "
                        f"unknown: {sorted(unknown)}")
    where = f"{where} {raw['name']}"
    if not isinstance(raw["argv"], list):
        raise UserError(f"{where}: argv must be a list (one item per argument), not {type(raw['argv']).__name__}")
    return Stage(name=str(raw["name"]), argv=fill_argv(raw["argv"], variables, where),
                 limit=float(_fill(raw["limit"], variables, where)),
                 outputs=[_fill(o, variables, where) for o in raw.get("outputs", [])],
                 needs=[str(n) for n in raw.get("needs", [])], gpu_idle=bool(raw.get("gpu_idle", False)),
                 setup=[str(s) for s in raw.get("setup", [])],
                 env={k: _fill(v, variables, where) for k, v in raw.get("env", {}).items()},
                 grace=float(raw.get("grace", 30.0)), optional=bool(raw.get("optional", False)))


def ordered(stages: list[Stage], where: str) -> list[Stage]:
    """The stages in plan order, moved only as far as their ``needs`` require; an unknown need or a cycle is a
    UserError."""
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise UserError(f"{where}: two stages share a name: {names}")
    for s in stages:
        for need in s.needs:
            if need not in names:
                raise UserError(f"{where}: stage {s.name} needs {need!r}, which is not a stage of the plan")
    done: list[Stage] = []
    left = list(stages)
    while left:
        ready = next((s for s in left if all(n in {d.name for d in done} for n in s.needs)), None)
        if ready is None:
            raise UserError(f"{where}: the needs of {[s.name for s in left]} form a cycle")
        done.append(ready)
        left.remove(ready)
    return done


def load_plan(path: str | Path, sets: dict[str, str] | None = None, profile: str | None = None) -> Plan:
    """The plan at ``path`` resolved with ``profile``'s variables and then ``sets`` (``--set`` pairs)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{path}: cannot read the plan ({e})") from None
    if not isinstance(raw, dict) or "stages" not in raw:
        raise UserError(f"{path}: a plan is a mapping with at least 'stages' (see lab/plans/)")
    variables = {"root": str(ROOT), "python": sys.executable, **(raw.get("vars") or {})}
    profiles = raw.get("profiles") or {}
    chosen = {}
    if profile:
        if profile not in profiles:
            raise UserError(f"{path}: no profile {profile!r}; the plan has {sorted(profiles)}")
        chosen = profiles[profile] or {}
        variables = _merge_vars(variables, chosen.get("vars") or {}, "profile")
    variables = _merge_vars(variables, sets or {}, "--set")
    variables.setdefault("run", "run")
    run_dir = Path(_fill(raw.get("run_dir", "{run}"), variables, f"{path}: run_dir")).absolute()
    variables["run"] = str(run_dir)
    stages = [_stage(s, variables, f"{path}: stage") for s in raw["stages"]]
    setup = [SetupStep(name=str(s["name"]), command=_fill(s["command"], variables, f"{path}: setup {s['name']}"),
                       done=_fill(s["done"], variables, f"{path}: setup {s['name']}"),
                       brings=[str(b) for b in s.get("brings", [])]) for s in raw.get("setup") or []]
    steps = {s.name for s in setup}
    for s in stages:
        for step in s.setup:
            if step not in steps:
                raise UserError(f"{path}: stage {s.name} waits for setup {step!r}, which the plan does not have")
    return Plan(path=path, replaces=str(raw.get("replaces", "")), run_dir=run_dir, variables=variables,
                env={k: _fill(v, variables, f"{path}: env") for k, v in (raw.get("env") or {}).items()},
                setup=setup, stages=ordered(stages, str(path)),
                collect=[_fill(g, variables, f"{path}: collect") for g in raw.get("collect") or []],
                skip_setup=bool(chosen.get("skip_setup", False)))
