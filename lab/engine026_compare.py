"""One drafter served by vLLM 0.24 and by 0.26 (`dflashkit eval --engine vllm --per-prompt`, one report each) and
walked by `dflashkit eval --mode chain` on the same prompts: the JSON lab/testbed_engine026_lease.sh writes.

    python -m lab.engine026_compare --served 0.24=DIR 0.26=DIR --chain DIR --out compare.json

- τ of each release over every prompt at once (vLLM's counters), its relative difference from the first release
  (the goal: within 2%), and τ of each prompt sent alone (``per_prompt``);
- lossless per release: how many outputs with the drafter equal those without it (every prompt at once), and the
  prompts that differ with the first differing token (the report's ``lossless``, its first 20);
- the drafter's outputs of each prompt sent alone, release against release (outputs.jsonl): identical count and
  the ids that differ;
- τ of `dflashkit eval` (chain, greedy) on the same prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GOAL = 0.02  # the largest relative τ difference between releases taken as "the same"


def read_served(folder: Path) -> dict:
    report = json.loads((folder / "report.json").read_text())
    outputs = folder / "outputs.jsonl"
    records = [json.loads(line) for line in outputs.read_text().splitlines() if line.strip()] \
        if outputs.is_file() else []
    return {"report": report, "outputs": {f"{r['dataset']}#{r['id']}": r["tokens"] for r in records}}


def served_row(served: dict) -> dict:
    report = served["report"]
    lossless = report["lossless"]
    return {"vllm": report.get("versions", {}).get("vllm"), "tau": report["overall"]["tau"],
            "per_prompt_tau": (report.get("per_prompt") or {}).get("tau"),
            "identical_with_and_without_drafter": lossless["identical"], "requests": lossless["requests"],
            "differing": lossless["divergences"], "num_speculative_tokens": report.get("num_speculative_tokens")}


def compare(served: dict[str, dict], chain_report: dict | None) -> dict:
    releases = list(served)
    rows = {name: served_row(s) for name, s in served.items()}
    out = {"releases": rows}
    if len(releases) >= 2:
        first, second = releases[0], releases[1]
        t0, t1 = rows[first]["tau"], rows[second]["tau"]
        diff = (t1 - t0) / t0 if t0 else None
        a, b = served[first]["outputs"], served[second]["outputs"]
        common = sorted(set(a) & set(b))
        differing = [key for key in common if a[key] != b[key]]
        out["tau_between_releases"] = {"first": first, "second": second, "relative_difference": diff,
                                       "within_goal": diff is not None and abs(diff) <= GOAL, "goal": GOAL}
        out["drafter_outputs_between_releases"] = {"prompts": len(common), "identical": len(common) - len(differing),
                                                   "differing": differing}
    if chain_report is not None:
        out["dflashkit_eval"] = {"tau": chain_report["overall"]["tau"], "mode": "chain",
                                 "prompts": chain_report["overall"].get("prompts")}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--served", nargs="+", required=True, metavar="RELEASE=DIR", help="eval --engine vllm reports")
    p.add_argument("--chain", help="the `dflashkit eval --mode chain` report directory")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    served = {}
    for item in args.served:
        name, _, folder = item.partition("=")
        if (Path(folder) / "report.json").is_file():  # a release whose stage failed is left out, not guessed
            served[name] = read_served(Path(folder))
    chain = Path(args.chain or "") / "report.json"
    result = compare(served, json.loads(chain.read_text()) if args.chain and chain.is_file() else None)
    result["missing"] = [item for item in args.served if item.partition("=")[0] not in served]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "releases"}, indent=2)[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
