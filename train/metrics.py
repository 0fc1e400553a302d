"""Metric sums of training and held-out passes: additive on the device, reduced across ranks only for a log
line, then divided into the logged metrics (names as docs/ARCHITECTURE.md defines them)."""

from __future__ import annotations

import math

import torch

from .loss import BlockLossOutput


class MetricSums:
    """Additive sums of one or more passes; ``reduce`` sums them across ranks, ``metrics`` divides."""

    def __init__(self, positions: int, device, term=None):
        self.term = term  # the drafter kind's extra term (train/drafter_pass.py ExtraLossTerm), None: none logged
        slots = term.metric_count if term is not None else 0
        self.t = torch.zeros(6 + 2 * positions + slots, dtype=torch.float64, device=device)  # + the term's sums
        self.p = positions
        self.host_tokens = 0  # context tokens, counted on the host (joins t[5] in reduce)

    def add(self, out: BlockLossOutput, denom: torch.Tensor, scale: float, tokens: int) -> None:
        if scale == 0.0:
            return
        p = self.p
        vals = [out.loss_sum.detach(), denom, out.ce_sum, out.tau_sum, out.blocks]
        self.t[:5] += torch.stack([v.to(torch.float64) for v in vals]).to(self.t.device)
        self.t[6:6 + p] += out.correct.to(self.t)
        self.t[6 + p:6 + 2 * p] += out.counted.to(self.t)
        if out.extra is not None and self.term is not None:  # the kind's term: its own sums (metric_sums)
            vals = out.extra.metric_sums()
            self.t[6 + 2 * p:] += torch.stack([v.to(torch.float64) for v in vals]).to(self.t.device)
        self.host_tokens += int(tokens)

    def reduce(self, accelerator) -> "MetricSums":
        self.t[5] += self.host_tokens
        self.host_tokens = 0
        if accelerator is not None and accelerator.num_processes > 1:
            self.t = accelerator.reduce(self.t, reduction="sum")
        return self

    @property
    def tokens(self) -> float:
        return float(self.t[5])

    def metrics(self, prefix: str) -> dict:
        t, p = self.t.tolist(), self.p
        loss, denom, ce, tau, blocks = t[:5]
        counted = t[6 + p:6 + 2 * p]
        correct = t[6:6 + p]
        out = {f"{prefix}/loss": loss / denom if denom else float("nan"),
               f"{prefix}/ce": ce / sum(counted) if sum(counted) else float("nan"),
               # tau_sim is the held-out figure (docs/ARCHITECTURE.md); on training blocks the same count is train/tau
               f"{prefix}/{'tau_sim' if prefix == 'eval' else 'tau'}": tau / blocks if blocks else float("nan"),
               f"{prefix}/acc": sum(correct) / sum(counted) if sum(counted) else float("nan")}
        for k in range(p):
            out[f"{prefix}/acc_{k + 1}"] = correct[k] / counted[k] if counted[k] else float("nan")
        if self.term is not None:  # the kind's term (DFlash2: its loss, candidate recall, teacher-forced acc)
            out.update(self.term.metrics(t[6 + 2 * p:], prefix))
        return out


def json_safe(row: dict) -> dict:
    """``row`` with NaN and Inf written as null: metrics.jsonl and summary.json are strict JSON (a bare NaN is not
    JSON, and strict parsers reject the file); a metric with nothing to count, or a diverged step's loss, is null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
