"""The lossless check: speculative tokens against an independent reference, with near-ties told apart.

Design choices:
- The reference is Hugging Face `generate(do_sample=False)` on the same model: SDPA attention, its own cache,
  its own logits (the lm_head in the model's dtype). It shares nothing with the speculative path but the
  weights, so an error in our cache, attention, compaction or acceptance shows up as a divergence.
- Greedy decoding parts where the top two logits are within rounding: a 1-token step and an N-node verify sum
  in different orders. At the first divergence of a prompt (after it the two texts are no longer comparable)
  the reference's top-1 minus top-2 logit there is recorded. A margin within the dtype's tolerance,
  `TIE_TOLERANCE[dtype] * max(1, |top-1 logit|)`, is a numerical tie: either token is a correct greedy choice.
  A larger margin is a mismatch: the speculative path chose a token the target clearly did not want.
- Tolerances (relative to the logit): bf16 2^-5 (4 ulps of bf16's 2^-7), fp16 2^-8 (4 ulps of 2^-10), fp32
  2^-16 (kernels that reduce in another order across all layers). Mismatches must be 0 in every dtype.
- A length difference without a token difference (one side stopped) is a mismatch with no margin.
- The reference runs batched (16 prompts per generate call, left-padded with an attention mask): greedy tokens
  per prompt are those of a one-prompt call up to the rounding of padded batch kernels, which the tie
  classification already allows for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

TIE_TOLERANCE = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -5, torch.float16: 2.0 ** -8}


@dataclass
class ReferenceRun:
    tokens: list[int]  # the reference's new tokens
    margins: list[float]  # top-1 minus top-2 logit at each new token
    top1_logits: list[float]  # the top-1 logit at each new token (scales the tolerance)


@torch.inference_mode()
def reference_greedy(model: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                     stop_token_ids: tuple[int, ...]) -> ReferenceRun:
    """HF generate(do_sample=False) with SDPA and its own cache; stops after a stop token (none: never)."""
    return reference_greedy_batch(model, [prompt_ids], max_new_tokens, stop_token_ids)[0]


@torch.inference_mode()
def reference_greedy_batch(model: nn.Module, prompts: list[list[int]], max_new_tokens: int,
                           stop_token_ids: tuple[int, ...], batch_size: int = 16) -> list[ReferenceRun]:
    """reference_greedy for many prompts, `batch_size` per generate call (left-padded, with an attention mask):
    a decode step costs about as much for 16 sequences as for one, so the check costs a few generate calls."""
    from transformers import GenerationConfig

    previous_attention = model.config._attn_implementation
    previous_generation = model.generation_config
    pad = stop_token_ids[0] if stop_token_ids else 0
    model.set_attn_implementation("sdpa")
    model.generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(stop_token_ids) or None,
        pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    runs = []
    try:
        device = next(model.parameters()).device
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first:first + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            out = model.generate(ids, attention_mask=mask)
            top2 = torch.stack([step.float().topk(2, dim=-1).values for step in out.logits], dim=1).cpu()
            for row, new in enumerate(out.sequences[:, width:].tolist()):
                ends = [i for i, token in enumerate(new) if token in stop_token_ids]
                new = new[:ends[0] + 1] if ends else new  # after a stop token generate pads
                margins = (top2[row, :len(new), 0] - top2[row, :len(new), 1]).tolist()
                runs.append(ReferenceRun(tokens=new, margins=margins, top1_logits=top2[row, :len(new), 0].tolist()))
    finally:
        model.generation_config = previous_generation
        model.set_attn_implementation(previous_attention)
    return runs


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end when one is a prefix of the other)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def classify(prompt_ids: list[str], spec_tokens: list[list[int]], references: list[ReferenceRun],
             dtype: torch.dtype) -> dict:
    """report.json `lossless`: {prompts, exact_match_rate, ties, mismatches, divergences, reference}."""
    tolerance = TIE_TOLERANCE.get(dtype, TIE_TOLERANCE[torch.float32])
    divergences = []
    for prompt, tokens, ref in zip(prompt_ids, spec_tokens, references):
        index = first_divergence(tokens, ref.tokens)
        if index is None:
            continue
        ours = tokens[index] if index < len(tokens) else None
        theirs = ref.tokens[index] if index < len(ref.tokens) else None
        margin = ref.margins[index] if ours is not None and theirs is not None else None
        bound = tolerance * max(1.0, abs(ref.top1_logits[index])) if margin is not None else None
        divergences.append({"prompt": prompt, "token_index": index, "speculative_token": ours,
                            "reference_token": theirs, "reference_margin": margin, "tie_bound": bound,
                            "kind": "tie" if margin is not None and margin <= bound else "mismatch"})
    n = len(references)
    ties = sum(d["kind"] == "tie" for d in divergences)
    return {"prompts": n, "exact_match_rate": (n - len(divergences)) / n if n else 0.0, "ties": ties,
            "mismatches": len(divergences) - ties, "divergences": divergences,
            "reference": {"implementation": "transformers generate(do_sample=False)", "attention": "sdpa",
                          "cache": "its own (DynamicCache)", "dtype": str(dtype).removeprefix("torch."),
                          "tie_tolerance_relative": tolerance}}


def describe(lossless: dict) -> str:
    """The check in words, for report.md."""
    n, ties, mismatches = lossless["prompts"], lossless["ties"], lossless["mismatches"]
    exact = round(lossless["exact_match_rate"] * n)
    ref = lossless["reference"]
    text = (f"Compared with {ref['implementation']} ({ref['attention']}, {ref['cache']}, {ref['dtype']}) on {n} "
            f"prompts: {exact} identical, {ties} parted at a numerical tie (the reference's top two logits within "
            f"{ref['tie_tolerance_relative']:.2g} x |logit|, where either token is a correct greedy choice), "
            f"{mismatches} mismatched.")
    verdict = (" Lossless: no mismatch." if mismatches == 0 else
               " NOT lossless: a mismatch means the speculative path chose a token the target clearly did not want.")
    return text + verdict
