"""Held-out evaluation: loss, per-position accuracy and tau_sim at fixed anchors, and the live chain walk.

Design choices:
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
  exactly what live greedy chain decoding of the same prompt does
  (tests/integration/test_train_eval_consistency.py), so ``eval/tau_walk`` and ``eval/walk_accept_k`` (fraction
  of rounds whose draft position k was accepted, the report's per-position acceptance) are the held-out numbers
  to compare with an eval report.
- The walk follows the drafter's own proposal rule, as decoding does (drafter/kinds/): the argmax for DFlash,
  the candidate selector's greedy path for DFlash2 (the reference's rule, and vLLM's). The selector's accepted
  run is its teacher-forced choices' leading run (train/selector_loss.py ``runs``): up to its first miss the
  path has chosen the true tokens, so every predecessor it saw is the one teacher forcing gives it. For DFlash2
  the argmax walk is kept beside it (``eval/tau_walk_argmax``, ``eval/walk_argmax_accept_k``): what the selector
  adds or loses, position by position. Before 2026-12-06 a DFlash2 run's ``eval/tau_walk`` was the argmax walk.
- Held-out samples are packed like training's micro-batches (``batch_tokens``; the trainer gives its
  micro-batch, capped at ``max_length``, so a pass holds no more anchors than one longest sample's did) and each
  pack's features are read once for both passes: an online run's target runs once per pack in right-padded
  batches (``OnlineFeatures.read``) instead of twice per sample, alone. On the testbed's GPU runs the
  per-sample form took ~3 s (H100) to ~5 s (H200) per evaluation of 64 samples. Sums are over blocks, so
  packing changes the numbers by float rounding only; anchors are keyed
  by sample index, so the same samples are evaluated at the same anchors however they are packed.
- Compiled drafter layers in one plain process (no DDP, FSDP or DeepSpeed wrapper) run the evaluation's passes
  in grad mode, with the model left in train mode as the graphs were compiled (the drafter has no dropout: the
  same numbers), so the graphs the training compiled serve them. In no-grad mode every layer was compiled again
  at the first evaluation: its window took 19.5 s on one H100 against 3.5 s now, with no recompilation of the
  layers in the training log. Each pass's autograd graph
  is dropped with its output, and the passes' DFlash2 options that act only under a gradient (the injected
  label, the coupled unary logits) are off, as in no-grad mode; the block loss computes no gradient of the
  states (``loss_grad=False``), which the loss engine would otherwise compute with the loss. A wrapped model
  keeps no-grad mode: a forward in grad mode without a backward would leave its hooks waiting.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace

import torch

from dflashkit.drafter.kinds import drafter_kind

from .data import CollateOptions, collate_blocks, pack_order
from .drafter_pass import PassOptions, extra_term_of, forward_blocks, layers_compiled
from .metrics import MetricSums
from .objectives import loss_denominator


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


def eval_pack_tokens(micro_batch_tokens: int, max_length: int | None) -> int:
    """The held-out packs' token budget (``evaluate``'s ``batch_tokens``): the training's micro-batch capped at
    ``max_length``, so a pack holds no more anchors than one sample could; 0 (training one sequence at a time)
    keeps one sample per pass."""
    if micro_batch_tokens <= 0:
        return 0
    return min(micro_batch_tokens, max_length) if max_length else micro_batch_tokens


def read_samples(dataset, indices: list[int]) -> dict[int, dict]:
    """{index: sample dict} of these samples; a dataset with ``read`` (train/online.OnlineFeatures) computes them
    together (the target batched), any other is read one index at a time."""
    read = getattr(dataset, "read", None)
    return read(indices) if read is not None else {i: dataset[i] for i in indices}


def training_graphs(model, accelerator) -> bool:
    """Whether ``evaluate``'s passes run through the training's compiled graphs (the module notes): compiled
    layers in one process, the model not wrapped."""
    if accelerator is not None and (accelerator.num_processes > 1 or accelerator.unwrap_model(model) is not model):
        return False
    return layers_compiled(model)


@torch.no_grad()
def evaluate(model, head, dataset, indices: list[int], passes: PassOptions, anchors: CollateOptions, *,
             batch_tokens: int = 0, accelerator=None, device=None) -> dict:
    """Held-out loss (ce objective), per-position accuracy and tau_sim at fixed anchors, and the chain walk's
    tau_walk and per-position acceptance by the drafter's proposal rule (DFlash2: its selector's path, and the
    argmax walk beside it, whatever ``passes.extra_term`` says).

    ``passes``: the run's drafter pass options (train/pass_options.py), run as ``PassOptions.held_out``: the
    ``ce`` objective with the run's decay, chunking and kernels, the data's labels; ``extra_term``: the kind's
    extra term's metrics too (DFlash2's selector metrics, train/drafter_pass.py) with the run's ``term_options``
    as the kind evaluates them (``evaluation()``: DFlash2's pairwise term by the kernels with ``kernel``, and the
    three options that act only under a gradient, unary and hidden gradients and injected labels, left out of
    every pass; no gradient is taken, so the numbers are the same), and the ``ce`` objective's position weights
    are the decay. ``anchors``: the samples' block, anchors per sample, seed and truncation (the held-out anchors
    are fixed whatever its ``fixed_anchors`` says).
    ``batch_tokens`` > 0 packs the samples up to that many tokens per pass (``eval_pack_tokens``; it needs the
    dataset's ``lengths``); 0 evaluates one sample per pass."""
    block_size, max_length, gamma = passes.block_size, anchors.max_length, passes.loss.gamma
    if anchors.block_size != block_size:
        raise ValueError(f"evaluate: the anchors' block_size {anchors.block_size} is not the pass's {block_size}")
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    device = device or (accelerator.device if accelerator is not None else torch.device("cpu"))
    lengths = getattr(dataset, "lengths", None)
    packs = (pack_order(list(indices), lengths, batch_tokens, max_length) if batch_tokens > 0 and lengths is not None
             else [[i] for i in indices])
    per_rank = math.ceil(len(packs) / world)
    # every rank runs the same number of passes (ZeRO-3 and FSDP gather inside them); a padding pass counts zero
    slots = [(packs[i * world + rank], False) if i * world + rank < len(packs) else (packs[0], True)
             for i in range(per_rank)]
    # the fixed anchors' blocks, and every anchor candidate's for the chain walk
    fixed = replace(anchors, epoch=0, use_last_hidden=False, fixed_anchors=True, anchor_density=0.0)
    every_anchor = replace(fixed, num_anchors=1 << 40, fixed_anchors=False)
    kind = drafter_kind(model)
    held_out = passes.term_options if passes.term_options is not None else kind.default_options()
    held_out = None if held_out is None else held_out.evaluation()  # the kind's options for held-out passes
    scored, walked_pass = passes.held_out(held_out), passes.held_out(held_out, extra_term=True)
    graphs = training_graphs(model, accelerator)  # the module notes
    was_training = model.training
    model.train(graphs)
    sums = MetricSums(block_size - 1, device, extra_term_of(model) if passes.extra_term else None)
    # per proposal rule, rounds, tokens, accepted[k]: host integers, one transfer at the end. "": the drafter's
    # own rule (DFlash2: the selector's path); "_argmax": the argmax beside it, for a kind that proposes otherwise
    rules = ("",) if kind.proposes_argmax else ("", "_argmax")
    walks = {rule: [0] * (1 + block_size) for rule in rules}
    for pack, padding in slots:
        read = read_samples(dataset, pack)
        samples = [{**read[i], "index": i} for i in pack]
        scale = 0.0 if padding else 1.0
        batch = collate_blocks(samples, fixed, scale=scale)
        batch = batch.to(device)
        with torch.enable_grad() if graphs else nullcontext():
            out = forward_blocks(model, head, batch, scored)
        sums.add(out, loss_denominator(batch.valid, "ce", gamma), batch.scale, batch.num_tokens)
        del out  # and its autograd graph, before the next pass
        # the chain walk: every anchor candidate of the same samples, runs only
        every = collate_blocks(samples, every_anchor, scale=scale, check_finite=False)
        every = every.to(device)
        with torch.enable_grad() if graphs else nullcontext():  # a DFlash2 drafter's selector whatever its weight
            walked = forward_blocks(model, head, every, walked_pass)
        if padding:
            continue
        extra = walked.extra
        by_rule = {"": walked.runs} if extra is None else {"": extra.runs, "_argmax": walked.runs}
        anchors = every.anchors.tolist()
        for rule, runs in by_rule.items():
            runs, walk = runs.tolist(), walks[rule]
            for s in range(len(every.block_offsets) - 1):
                lo, hi, start = every.block_offsets[s], every.block_offsets[s + 1], every.context_offsets[s]
                rounds, tokens, accepted = chain_walk([a - start for a in anchors[lo:hi]], runs[lo:hi], block_size)
                walk[:] = [w + n for w, n in zip(walk, [rounds, tokens, *accepted])]
    model.train(was_training)
    metrics = sums.reduce(accelerator).metrics("eval")
    for rule, walk in walks.items():
        totals = torch.tensor(walk, dtype=torch.float64, device=device)
        if accelerator is not None and accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        rounds, tokens, *accepted = totals.tolist()
        metrics[f"eval/tau_walk{rule}"] = tokens / rounds if rounds else float("nan")
        for k, n in enumerate(accepted):
            metrics[f"eval/walk{rule}_accept_{k + 1}"] = n / rounds if rounds else float("nan")
    return metrics
