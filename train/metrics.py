"""Metric sums of training and held-out passes: additive on the device, reduced across ranks only for a log
line, then divided into the logged metrics (names as docs/ARCHITECTURE.md defines them)."""

from __future__ import annotations

import math

import torch

from .loss import BlockLossOutput


class MetricSums:
    """Additive sums of one or more passes; ``reduce`` sums them across ranks, ``metrics`` divides."""

    def __init__(self, positions: int, device):
        self.t = torch.zeros(6 + 2 * positions + 5, dtype=torch.float64, device=device)  # + 5 selector sums
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
        if out.selector is not None:  # DFlash2: loss, normaliser, labels among the candidates, chosen, labels
            s = out.selector
            vals = [s.loss_sum.detach(), s.weight_sum, s.in_candidates, s.correct, s.counted]
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
        sel_loss, sel_weight, sel_in, sel_correct, sel_counted = t[6 + 2 * p:]
        out = {f"{prefix}/loss": loss / denom if denom else float("nan"),
               f"{prefix}/ce": ce / sum(counted) if sum(counted) else float("nan"),
               # tau_sim is the held-out figure (docs/ARCHITECTURE.md); on training blocks the same count is train/tau
               f"{prefix}/{'tau_sim' if prefix == 'eval' else 'tau'}": tau / blocks if blocks else float("nan"),
               f"{prefix}/acc": sum(correct) / sum(counted) if sum(counted) else float("nan")}
        for k in range(p):
            out[f"{prefix}/acc_{k + 1}"] = correct[k] / counted[k] if counted[k] else float("nan")
        if sel_counted:  # DFlash2 (train/selector_loss.py): the term, its candidate recall, its teacher-forced acc
            out.update({f"{prefix}/selector_loss": sel_loss / sel_weight,
                        f"{prefix}/selector_recall": sel_in / sel_counted,
                        f"{prefix}/selector_acc": sel_correct / sel_counted})
        return out


def json_safe(row: dict) -> dict:
    """``row`` with NaN and Inf written as null: metrics.jsonl and summary.json are strict JSON (a bare NaN is not
    JSON, and strict parsers reject the file); a metric with nothing to count, or a diverged step's loss, is null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
