"""Sampling from a target or drafter: the filtered distribution, a draw from it, and the rejection rule of
speculative sampling. Used by regeneration (extract/generation/generator.py) and eval (eval/decoder.py).

Design choices:
- One distribution for every sampled token, as the reference implementation builds it: softmax(logits / T) over
  the top_k most likely tokens (0 = all), then the smallest set of most likely tokens whose mass reaches top_p
  (the token that crosses top_p stays), renormalised; fp32 throughout. It is the rule of Hugging Face's warpers
  (temperature, top-k, top-p) as well, written in probabilities.
- ``sample_next`` draws with the exponential race, argmax(p / E) with E ~ Exp(1) (a categorical draw without a
  host round trip, so a CUDA graph can hold it); greedy is the argmax of the fp32 logits.
- ``sampled_accept_chain`` is speculative sampling on a chain: draft x at depth k is kept with probability
  min(1, p(x) / q(x)); at the first rejection the token is drawn from max(p - q, 0) renormalised, and when every
  draft is kept the bonus is drawn from p after the last one. The emitted tokens are distributed as the target's
  own samples (lossless).
- drafter/modeling_dflash.py ships inside exports and imports nothing of dflashkit, so it keeps its own copy of
  the filter and the rejection rule; tests/unit/targets/test_runtime_sampling.py checks the two give the same
  outputs.
"""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The fp32 distribution [..., V] a token is drawn from (see the module docstring); temperature > 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    scores = logits.float() / temperature
    indices = None
    if 0 < top_k < scores.shape[-1]:
        scores, indices = torch.topk(scores, top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # the mass strictly before the token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if indices is not None:
        probs = torch.zeros(logits.shape, dtype=probs.dtype, device=probs.device).scatter(-1, indices, probs)
    return probs


def sample_next(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The next token per row of [B, V] logits: the argmax when temperature <= 0, else an exponential-race draw
    from ``sampling_probs`` (from the default generator)."""
    if temperature <= 0:
        return logits.float().argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    race = torch.empty_like(probs).exponential_(1.0).clamp_min_(torch.finfo(torch.float32).tiny)  # never 0 / 0
    return (probs / race).argmax(dim=-1)


def sampled_accept_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                         generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling on a chain.

    draft_tokens [D]: the drafted tokens (depths 1..D); draft_probs [D, V]: the drafter's distribution each was
    drawn from; target_probs [D + 1, V]: the target's distribution after the root and after each draft.
    Returns (number of drafts accepted, the next token: the replacement at the first rejection, or the bonus).
    """
    num_drafts = draft_tokens.shape[0]
    device = target_probs.device
    uniform = torch.rand(num_drafts, generator=generator, device=device)
    rows = torch.arange(num_drafts, device=device)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    keep = (uniform * q < p).tolist()  # u < p / q without dividing by q
    accepted = 0
    while accepted < num_drafts and keep[accepted]:
        accepted += 1
    if accepted == num_drafts:
        final = target_probs[num_drafts]
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        total = residual.sum()
        final = residual / total if total.item() > 0 else target_probs[accepted]  # p == q: nothing to correct
    return accepted, torch.multinomial(final, 1, generator=generator).item()
