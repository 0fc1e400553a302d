"""One drafter pass over a packed micro-batch (one or more sequences and all their blocks), and the held-out
evaluation built on it.

Design choices:
- The block ids are embedded with the target's embedding (times its embedding scale) and every block of the
  micro-batch goes through the drafter in one forward with the packed block mask (train/block_mask.py), which
  keeps each block inside its own sequence. Only draft positions 1..B-1 reach the lm_head; position 0 (the
  anchor) predicts nothing.
- Nothing in a training pass waits for the GPU: masks are built on the device, metric sums stay there, and the
  host-side counts (tokens) join them only when the sums are reduced for a log line.
- Held-out metrics always use the ``ce`` objective, whatever the training loss, so runs with different loss
  variants are compared on the same number. Anchors are fixed per sample (train/anchors.eval_anchors), so
  the same checkpoint gives the same numbers on every run.
- ``evaluate`` works with or without an Accelerator: every rank runs the same number of passes (padding
  passes count zero), which ZeRO-3 and FSDP need, and the sums are reduced across ranks.
- tau_sim averages the acceptance length over anchors drawn uniformly, but live decoding does not visit
  anchors uniformly: a round that accepts r drafts skips the next r positions, so easy stretches get few rounds
  and hard ones many, and the live tau (tokens / rounds) is close to a harmonic, not an arithmetic, mean of the
  per-anchor lengths. ``evaluate`` therefore also replays the chain walk (``chain_walk``) over every anchor of
  each held-out assistant turn: start at the turn's first token, accept the run found there, move to the bonus
  token, and so on, with the engine's rules at the end of the turn. On target-written (greedy) data this is
  exactly what live greedy chain decoding of the same prompt does (tests/test_train_eval_consistency.py), so
  ``eval/tau_walk`` and ``eval/walk_accept_k`` (fraction of rounds whose draft position k was accepted, the
  report's per-position acceptance) are the held-out numbers to compare with an eval report.
"""

from __future__ import annotations

import math

import torch

from .block_mask import build_block_masks
from .data import BlockSource, PackedBlocks, block_loader
from .loss import BlockLossOutput, block_loss, loss_denominator
from .selector_loss import predecessor_ids, selector_loss


def mask_backend(attention: str, device: torch.device) -> str:
    """"dense" (SDPA bool mask; the CPU path), "flex" (BlockMask; on CUDA the drafter runs a compiled
    flex_attention that skips fully masked tiles) or "split" (train/split_attention.py)."""
    if attention != "auto":
        return attention
    return "flex" if device.type == "cuda" else "dense"


def compile_layers(model, dynamic: bool | None = True) -> None:
    """``torch.compile`` each decoder layer of the drafter (the fastest compiled unit measured, BENCHMARKS.md),
    for symbolic sizes from the first call (``dynamic=True``).

    Every packed micro-batch has its own context and block counts. Left to decide itself (``dynamic=None``), a
    compiled layer is specialised to the first shape and recompiled with dynamic sizes at the next one, and that
    recompiled graph ran the flex_attention kernels far slower than a layer compiled dynamic from the start, on
    the same inputs (BENCHMARKS.md, bench/bench_train_throughput.py --layer-probe). ``dynamic=None`` keeps the
    old behaviour (for the
    comparison). Every layer can be compiled many times over a run; the dynamo cache limit is raised for that."""
    import torch._dynamo as dynamo

    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    for layer in model.layers:
        layer.compile(dynamic=dynamic)


def draft_hidden(model, head, batch: PackedBlocks, *, block_size: int, layer_types: list[str],
                 sliding_window: int | None, backend: str = "dense", selector_targets: dict | None = None):
    """The drafter's final hidden states at draft positions 1..B-1 of every block: [N, B-1, H]; with
    ``selector_targets`` (DFlash2) also the selector's (scores, candidate_ids) from the same forward."""
    n = batch.anchors.numel()
    mask = build_block_masks(batch.anchors, batch.ctx_len, block_size, layer_types, sliding_window, backend,
                             context_start=batch.context_start)
    noise = head.embed(batch.block_ids)
    extra = {} if selector_targets is None else {"selector_targets": selector_targets}
    hidden = model(position_ids=batch.position_ids, attention_mask=mask, noise_embedding=noise,
                   target_hidden=batch.target_hidden, **extra)
    if selector_targets is not None:
        hidden, scores = hidden
        return hidden.view(n, block_size, -1)[:, 1:], scores
    return hidden.view(n, block_size, -1)[:, 1:]


@torch.no_grad()
def target_argmax_labels(head, batch: PackedBlocks, chunk_tokens: int = 2048) -> torch.Tensor:
    """The target's greedy choice for every label of ``batch``: label k of the block at a becomes
    argmax lm_head(last_hidden[a+k-1]) where the label is valid (0 elsewhere, as the data labels). The logits are
    taken once per context row (fewer rows than labels), in the lm_head's dtype as the ``kl`` teacher's, then
    compared in fp32."""
    if batch.last_hidden is None:
        raise ValueError("labels=target_argmax needs the target's last_hidden in every micro-batch; extract the "
                         "shards with --store-last-hidden, train online, or use labels=data")
    weight, bias = head.lm_head.weight, head.lm_head.bias
    rows = batch.last_hidden
    choice = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
    for s in range(0, rows.shape[0], chunk_tokens):
        logits = torch.nn.functional.linear(rows[s:s + chunk_tokens].to(weight.dtype), weight, bias)
        choice[s:s + chunk_tokens] = logits.float().argmax(-1)
    return torch.where(batch.valid, choice[batch.teacher_index], torch.zeros_like(batch.labels))


def forward_blocks(model, head, batch: PackedBlocks, *, block_size: int, layer_types: list[str],
                   sliding_window: int | None, backend: str = "dense", variant: str = "ce", gamma: float = 7.0,
                   dpace_alpha: float = 0.5, kl_weight: float = 0.5, chunk_tokens: int = 2048,
                   fused_loss: bool = False, labels: str = "data") -> BlockLossOutput:
    """The un-normalised block loss (and metrics) of one packed micro-batch (fused_loss: train/loss.py);
    ``labels="target_argmax"``: against the target's greedy tokens (``target_argmax_labels``), not the data's."""
    targets = target_argmax_labels(head, batch, chunk_tokens) if labels == "target_argmax" else batch.labels
    dflash2 = hasattr(getattr(model, "module", model), "candidate_selector")  # DFlash2: + the selector term
    sel = None if not dflash2 else dict(lm_head_weight=head.lm_head.weight.detach(), chunk_tokens=chunk_tokens,
                                        lm_head_bias=None if head.lm_head.bias is None else head.lm_head.bias.detach(),
                                        predecessor_ids=predecessor_ids(batch.block_ids, targets))
    hidden = draft_hidden(model, head, batch, block_size=block_size, layer_types=layer_types,
                          sliding_window=sliding_window, backend=backend, selector_targets=sel)
    if dflash2:
        hidden, (scores, candidates) = hidden
    teacher = None
    if variant == "kl":
        teacher = batch.last_hidden[batch.teacher_index]  # stored after the target's final norm
    out = block_loss(hidden, head.lm_head.weight, targets, batch.valid, variant=variant, gamma=gamma,
                     dpace_alpha=dpace_alpha, kl_weight=kl_weight, teacher_hidden=teacher,
                     lm_head_bias=head.lm_head.bias, chunk_tokens=chunk_tokens, fused=fused_loss)
    if dflash2:
        out.selector = selector_loss(scores, candidates, targets, batch.valid, gamma)
    return out


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


def chain_walk(anchors: list[int], runs: list[int], block_size: int) -> tuple[int, int, list[int]]:
    """Live greedy chain decoding replayed over one sequence: (rounds, tokens produced, accepted[k] = rounds whose
    draft position k + 1 was accepted).

    ``anchors`` must be every anchor candidate of the sequence (train/anchors.anchor_candidates, ascending) and
    ``runs`` each one's leading run of correct draft positions. Consecutive candidates s..t form one assistant
    turn ending at e = t + 1 (its end-of-turn token): rounds start at s; a round at a produces
    min(1 + run, e - a) tokens (the engine stops at the end-of-turn token and drops the bonus after it) and the
    next round starts at the token after them, until a reaches e.
    """
    accepted = [0] * (block_size - 1)
    run_of = dict(zip(anchors, runs))
    rounds = tokens = 0
    i = 0
    while i < len(anchors):
        j = i
        while j + 1 < len(anchors) and anchors[j + 1] == anchors[j] + 1:
            j += 1
        a, end = anchors[i], anchors[j] + 1
        while a < end:
            r = int(run_of[a])
            produced = min(1 + r, end - a)
            rounds, tokens = rounds + 1, tokens + produced
            for k in range(min(r, block_size - 1)):
                accepted[k] += 1
            a += produced
        i = j + 1
    return rounds, tokens, accepted


@torch.no_grad()
def evaluate(model, head, dataset, indices: list[int], *, block_size: int, layer_types: list[str],
             sliding_window: int | None, mask_token_id: int, num_anchors: int, seed: int, gamma: float = 7.0,
             max_length: int | None = None, backend: str = "dense", chunk_tokens: int = 2048,
             fused_loss: bool = False, accelerator=None, device=None) -> dict:
    """Held-out loss (ce objective), per-position accuracy and tau_sim at fixed anchors."""
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    device = device or (accelerator.device if accelerator is not None else torch.device("cpu"))
    per_rank = math.ceil(len(indices) / world) if indices else 0
    slots = [(indices[i * world + rank], False) if i * world + rank < len(indices) else (indices[0], True)
             for i in range(per_rank)]
    source = BlockSource(dataset, slots, block_size=block_size, mask_token_id=mask_token_id,
                         num_anchors=num_anchors, seed=seed, epoch=0, max_length=max_length,
                         use_last_hidden=False, fixed_anchors=True)
    was_training = model.training
    model.eval()
    sums = MetricSums(block_size - 1, device)
    for batch in block_loader(source):
        batch = batch.to(device)
        out = forward_blocks(model, head, batch, block_size=block_size, layer_types=layer_types,
                             sliding_window=sliding_window, backend=backend, variant="ce", gamma=gamma,
                             chunk_tokens=chunk_tokens, fused_loss=fused_loss)
        sums.add(out, loss_denominator(batch.valid, "ce", gamma), batch.scale, batch.num_tokens)
    walk = torch.zeros(1 + block_size, dtype=torch.float64, device=device)  # rounds, tokens, accepted[k]
    every = BlockSource(dataset, slots, block_size=block_size, mask_token_id=mask_token_id, num_anchors=1 << 40,
                        seed=seed, epoch=0, max_length=max_length, use_last_hidden=False)  # all candidates
    for batch in block_loader(every):  # padding passes run too (every rank the same passes), and count nothing
        batch = batch.to(device)
        out = forward_blocks(model, head, batch, block_size=block_size, layer_types=layer_types,
                             sliding_window=sliding_window, backend=backend, variant="ce", gamma=gamma,
                             chunk_tokens=chunk_tokens, fused_loss=fused_loss)
        if batch.scale == 0.0:
            continue
        anchors, runs = batch.anchors.tolist(), out.runs.tolist()
        for s in range(len(batch.block_offsets) - 1):
            lo, hi, start = batch.block_offsets[s], batch.block_offsets[s + 1], batch.context_offsets[s]
            rounds, tokens, accepted = chain_walk([a - start for a in anchors[lo:hi]], runs[lo:hi], block_size)
            walk += torch.tensor([rounds, tokens, *accepted], dtype=torch.float64, device=device)
    model.train(was_training)
    metrics = sums.reduce(accelerator).metrics("eval")
    if accelerator is not None and accelerator.num_processes > 1:
        walk = accelerator.reduce(walk, reduction="sum")
    rounds, tokens, *accepted = walk.tolist()
    metrics["eval/tau_walk"] = tokens / rounds if rounds else float("nan")
    for k, n in enumerate(accepted):
        metrics[f"eval/walk_accept_{k + 1}"] = n / rounds if rounds else float("nan")
    return metrics
