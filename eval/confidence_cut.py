"""Verification cut at a DSpark drafter's confidence head (arXiv 2607.05147 section 3.2): each round verifies the
drafts before the first whose confidence c_k is below a threshold (drafter/dspark_schedule.py
``confident_prefix_length``, the reference's static rule), instead of the whole chain.

The cut is lossless: the target still verifies every token it keeps (a shorter chain only accepts fewer drafts
per round, the bonus token included). What it saves is verification width; what it can cost is accepted tokens.
``dflashkit eval --confidence-threshold T`` decodes each prompt with the cut and again without it, and the report's
``confidence_cut`` holds both (tau and tokens verified per round), so the trade is read from one report.
"""

from __future__ import annotations

import torch

from dflashkit.drafter.dspark_schedule import confident_prefix_length
from dflashkit.errors import UserError


def check_confidence_cut(kind, threshold: float, mode: str) -> None:
    """UserError when a run asks for the cut where there is none: a threshold outside [0, 1), a tree, or a
    drafter kind without a confidence head."""
    if not 0.0 <= threshold < 1.0:
        raise UserError(f"--confidence-threshold {threshold}: it must be in [0, 1) (0: verify every draft)")
    if threshold > 0 and mode != "chain":
        raise UserError("--confidence-threshold cuts a chain of drafts; use --mode chain")
    if threshold > 0 and kind.confidence is None:
        raise UserError(f"--confidence-threshold needs a drafter with a confidence head (DSpark); this is a "
                        f"{kind.name} drafter: drop the option")


def confident_drafts(kind, drafter, hidden: torch.Tensor, anchor: int, drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, threshold: float):
    """The round's drafts [P] (and their distributions) cut before the first draft whose confidence is below
    ``threshold``; hidden [P, H]: the drafter's final states of the draft positions. Each c_k reads the token
    before draft k (the anchor, then the drafts), as the head was trained."""
    prev = torch.cat([drafts.new_full((1,), anchor), drafts[:-1]])
    logits = kind.confidence(drafter, hidden.to(next(drafter.parameters()).dtype), prev)
    keep = int(confident_prefix_length(logits[None], threshold)[0])
    return drafts[:keep], None if draft_probs is None else draft_probs[:keep]


def cut_numbers(results: list) -> dict:
    """tau (tokens per round) and the tokens the target verified per round (the anchor and the drafts) of the
    runs ``results`` (GenerationResult)."""
    lengths = [n for r in results for n in r.acceptance_lengths]
    verified = [n for r in results for n in r.nodes_per_round]
    return {"prompts": len(results), "rounds": len(lengths),
            "tau": sum(lengths) / len(lengths) if lengths else float("nan"),
            "verified_per_round": sum(verified) / len(verified) if verified else float("nan")}


def confidence_cut_report(threshold: float, with_cut: list, without_cut: list) -> dict:
    """The report's ``confidence_cut``: the same prompts decoded with the cut and without it."""
    return {"threshold": threshold, "with": cut_numbers(with_cut), "without": cut_numbers(without_cut)}
