"""Live speculative decoding of a target with a DFlash drafter: the round loop, and the autoregressive baseline.

One round (batch 1, as the reference `dflash_generate`):
  1. the drafter sees the new context features (the target layer outputs of the tokens accepted last round) and
     the block [anchor, MASK x (B-1)]; it keeps its own cache of context K/V, holding nothing past the anchor;
  2. chain: argmax (or a sample) per draft position, or for a DFlash2 drafter its candidate selector's path (the
     reference's `propose`; chain only), for a DSpark drafter its Markov walk (each draft biased by the one before,
     as vLLM 0.26; chain only), optionally cut at its confidence head (eval/confidence_cut.py); tree: best-first
     top-k tree up to the node budget;
  3. one target forward over all candidate nodes (tree attention, positions = prefix length + depth);
  4. accept the longest path the target agrees with, plus the bonus token (eval/acceptance.py);
  5. keep only the accepted nodes' K/V (compaction) and pass their features on as the next context.
Lengths and stopping follow the reference exactly (a round produces min(accepted + 1, room left) tokens, the
last block shrinks to the room left, a stop token ends the sequence and counts), so acceptance lengths can be
compared round by round. The baseline runs the same verifier one token per step: the same harness.
On CUDA the target's steps after the prefill (AR step, chain block, tree padded to the budget; eval/verifier.py)
and the drafter's pass (eval/draft_step.py) replay CUDA graphs, captured once per shape on static caches
(`cuda_graphs=False` for eager); the CPU runs the same code eagerly; `prepare(max_prompt_len)` captures every
shape a run can take before it starts. Every drafter layout takes that static step (sliding-window layers get
their window and in-block causality as a mask over cache slots); `static_draft=False` runs the reference's way
instead (a transformers DynamicCache cropped back to the anchor, eagerly), the cross-check the tests compare with.
Host work per round is kept small, since at a few ms per step it weighs: a greedy chain round leaves the drafts
on the device (drafter -> argmax -> target step) and reads the device once, drafts and target argmax together,
before the acceptance walk on the host; a tree round reads the drafter's top-k (the tree grows on the host) and
the target's argmax. Kept features are a view (chain) or one gather (tree); the drafter's share of a round is
timed with CUDA events, so no sync separates draft and verify.
The target's parts (decoder, embedding, lm_head: targets/runtime/parts.py) are resolved once per run and handed
down: run_eval gives the decoder its loaded Target (a TargetParts), the decoder gives the same parts to its
verifier. Use the decoder as a context manager: leaving it gives the target back as it was (`close`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.drafter.config import check_block_size
from dflashkit.drafter.kinds import drafter_kind
from dflashkit.errors import UserError
from dflashkit.targets.loading import target_parts
from dflashkit.targets.runtime.parts import TargetParts, attention_only
from dflashkit.targets.runtime.sampling import sampled_accept_chain, sampling_probs

from .acceptance import greedy_accept
from .confidence_cut import check_confidence_cut, confident_drafts
from .draft_step import Draft, StaticDrafter, draft_from_hidden, sample_selector_path, supports_static_steps
from .tree import DraftTree, build_tree


@dataclass
class DecodeConfig:
    mode: str = "chain"  # "chain" (one draft per position) or "tree" (best-first top-k tree)
    block_size: int | None = None  # tokens per block incl. the anchor; None = the drafter's block_size
    tree_budget: int = 64  # tree mode: nodes verified per round, root included
    tree_top_k: int = 8  # tree mode: candidate tokens per draft position
    temperature: float = 0.0  # 0 = greedy; > 0 = lossless speculative sampling (chain only)
    top_p: float = 1.0  # sampling: keep the smallest set of tokens whose probability reaches top_p (1 = all)
    top_k: int = 0  # sampling: keep the k most likely tokens (0 = all)
    max_new_tokens: int = 256  # new tokens per prompt (the first comes from the prefill)
    stop_token_ids: tuple[int, ...] = ()  # generation ends after one of these (it is kept)
    attention_backend: str = "auto"  # tree attention: auto (Triton on CUDA), triton, torch
    cuda_graphs: bool = True  # replay the target's decode steps as CUDA graphs (CUDA only; the CPU runs eagerly)
    static_draft: bool = True  # drafter pass on a static cache (graph-captured on CUDA); False = DynamicCache, eager
    seed: int = 0  # sampling generator seed (reset per prompt)
    # chain, a drafter with a confidence head (DSpark): verify each round's drafts up to the first whose confidence
    # is below this (eval/confidence_cut.py); 0 = every draft
    confidence_threshold: float = 0.0

    def check(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise UserError(f"mode must be 'chain' or 'tree', got {self.mode!r}")
        if self.mode == "tree" and self.temperature > 0:
            raise UserError("tree mode is greedy only; speculative sampling (--temperature > 0) runs on a chain "
                            "(--mode chain)")
        if self.temperature < 0 or self.max_new_tokens < 1 or self.tree_budget < 1 or self.tree_top_k < 1:
            raise UserError("temperature must be >= 0, max_new_tokens, tree_budget and tree_top_k >= 1")
        if self.block_size is not None:
            check_block_size(self.block_size)
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserError(f"top_p must be in (0, 1] and top_k >= 0 (0 = off), got {self.top_p}, {self.top_k}")


@dataclass
class GenerationResult:
    prompt_len: int
    tokens: list[int]  # new tokens (the first from the prefill)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens produced per round (accepted + bonus)
    accepted_drafts: list[int] = field(default_factory=list)  # draft tokens accepted per round (before caps)
    nodes_per_round: list[int] = field(default_factory=list)  # candidate nodes the target verified
    drafts: list[list[int]] = field(default_factory=list)  # per round, the drafted tokens (tree: nodes 1.., in order)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall time after the prefill
    draft_s: float = 0.0  # drafter passes and proposals (speculative runs; on CUDA timed with events)
    verify_s: float = 0.0  # the rest of the rounds: target forwards, acceptance, commit (AR: the steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _crop(cache, length: int) -> None:
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class SpeculativeDecoder:
    """Target + drafter. `generate(prompt_ids)` decodes speculatively; `generate_autoregressive` is the baseline.

    `target`: the target's parts, resolved once by the caller (a loaded Target is one); a bare Hugging Face model
    (scripts, tests) is resolved here. The verifier gets the same parts. `with SpeculativeDecoder(...) as decoder:`
    closes it (the target given back as it was) however the block ends.
    """

    def __init__(self, target: TargetParts | nn.Module, drafter: nn.Module, config: DecodeConfig):
        config.check()
        parts = target_parts(target)  # a TargetParts as it is; a bare HF model resolved now, the only time
        self.parts = parts
        self.model = parts.model
        self.drafter = drafter.eval()
        self.config = config
        self.block_size = config.block_size or drafter.block_size
        self.device = next(self.model.parameters()).device
        self.embed_weight = parts.embed_tokens.weight
        self.lm_head = parts.lm_head
        self.embed_scale = float(getattr(drafter, "input_embedding_scale", 1.0))
        self.mask_token_id = int(drafter.mask_token_id)
        kind = drafter_kind(drafter)
        kind.check_decoding(config.mode, self.block_size, drafter.block_size)  # DFlash2: chains, its trained block
        check_confidence_cut(kind, config.confidence_threshold, config.mode)
        self.kind = kind
        self.selector = kind.selector_of(drafter)  # DFlash2: proposals are the selector's path
        from .verifier import TargetVerifier

        if not attention_only(parts):
            from .hybrid import TREE_REFUSAL, HybridChainVerifier

            if config.mode == "tree":
                raise UserError(TREE_REFUSAL)
            self.verifier = HybridChainVerifier(parts, drafter.target_layer_ids)
        else:
            self.verifier = TargetVerifier(parts, drafter.target_layer_ids, config.attention_backend,
                                           config.cuda_graphs)
        self.generator = torch.Generator(device=self.device)
        # start and end of a round's draft on the device (CUDA): its share of the round without a host sync
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" \
            else None
        self.static_drafter = None  # static context cache, CUDA graphs on CUDA (every layout the drafter has)
        if config.static_draft and supports_static_steps(drafter):
            self.static_drafter = StaticDrafter(drafter, self.embed_weight, self.embed_scale, self.lm_head,
                                                self.mask_token_id, self.block_size,
                                                config.cuda_graphs and getattr(self.verifier, "cuda_graphs", True))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return sampling_probs(logits, cfg.temperature, cfg.top_p, cfg.top_k)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The token after one row of logits (argmax, or a sample), as a device tensor [1]."""
        if self.config.temperature > 0:
            return torch.multinomial(self._probs(logits), 1, generator=self.generator)
        return logits.argmax(dim=-1, keepdim=True)

    def _room(self, prompt_len: int) -> int:
        """Cache slots a sequence needs: prompt + new tokens + one round of nodes."""
        return prompt_len + self.config.max_new_tokens + max(self.block_size, self.config.tree_budget) + 1

    @torch.inference_mode()
    def prepare(self, max_prompt_len: int) -> None:
        """Before a run: room for its longest prompt, and every decode step it can take built now (on CUDA:
        captured as CUDA graphs), so that no capture lands inside a timed decode. Call it between sequences."""
        cfg = self.config
        room = self._room(max_prompt_len)
        self.verifier.reserve(room)
        sizes = list(range(2, min(self.block_size, cfg.max_new_tokens) + 1))  # block lengths a round can have
        chain_steps = [(n, True) for n in sizes] if cfg.mode == "chain" else [(cfg.tree_budget, False)]
        self.verifier.prepare([(1, True), *chain_steps])  # the AR step, then the round's verify steps
        if self.static_drafter is not None:
            self.static_drafter.reserve(room)
            self.static_drafter.prepare(sizes)

    def _prefill(self, prompt_ids: list[int]):
        """(first new token, it on the device [1], the prompt's features, seconds)."""
        room = self._room(len(prompt_ids))  # the one place the caches are sized
        self.verifier.reserve(room)
        if self.static_drafter is not None:
            self.static_drafter.reserve(room)
        self.verifier.reset()
        self.generator.manual_seed(self.config.seed)
        _sync(self.device)
        start = time.perf_counter()
        logits, features = self.verifier.forward(torch.tensor(prompt_ids, device=self.device),
                                                 last_logits_only=True)
        self.verifier.commit(list(range(len(prompt_ids))))
        token = self._pick(logits[-1])
        first = int(token)
        return first, token, features, time.perf_counter() - start

    @torch.inference_mode()
    def generate_autoregressive(self, prompt_ids: list[int]) -> GenerationResult:
        """Greedy (or sampled) decoding one token per target forward, through the same verifier. The token goes
        from one step to the next on the device; each step reads it once (the stop check needs it)."""
        first, token, _, prefill_s = self._prefill(prompt_ids)
        result = GenerationResult(len(prompt_ids), [first], prefill_s=prefill_s)
        stop = set(self.config.stop_token_ids)
        start = time.perf_counter()
        while len(result.tokens) < self.config.max_new_tokens and result.tokens[-1] not in stop:
            logits, _ = self.verifier.forward(token)
            self.verifier.commit([0])
            token = self._pick(logits[-1])
            result.tokens.append(int(token))
        _sync(self.device)
        result.decode_s = result.verify_s = time.perf_counter() - start
        return result

    def _draft(self, anchor: int, context: torch.Tensor, draft_cache, start: int, size: int) -> Draft:
        """The drafter's pass for positions start+1 .. start+size-1 (logits and greedy proposal)."""
        if self.static_drafter is not None:
            return self.static_drafter.draft(anchor, context, start, size)
        block = torch.full((1, size), self.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor
        noise = F.embedding(block, self.embed_weight) * self.embed_scale
        positions = torch.arange(start - context.shape[0], start + size, device=self.device).unsqueeze(0)
        hidden = self.drafter(position_ids=positions, noise_embedding=noise.to(self.drafter.dtype),
                              target_hidden=context.unsqueeze(0).to(self.drafter.dtype),
                              past_key_values=draft_cache, use_cache=True)
        _crop(draft_cache, start)
        return draft_from_hidden(self.drafter, hidden[:, 1 - size:, :], self.lm_head, block[:, 0])

    def _propose(self, anchor: int, draft: Draft, confidence_threshold: float = 0.0):
        """The round's candidates: a DraftTree grown on the host (tree mode), or the drafted tokens, left on the
        device (chain), with the drafter's distribution they were sampled from (sampling; else None); a chain cut
        at the confidence head's ``confidence_threshold`` when > 0 (eval/confidence_cut.py)."""
        cfg = self.config
        if cfg.mode == "tree":
            bias = None if self.kind.node_bias is None else partial(self.kind.node_bias, self.drafter)  # DSpark
            return build_tree(anchor, draft.logits, cfg.tree_budget, cfg.tree_top_k, bias), None
        drafts, probs = self._chain(anchor, draft)
        if confidence_threshold > 0:
            return confident_drafts(self.kind, self.drafter, draft.hidden[0], anchor, drafts, probs,
                                    confidence_threshold)
        return drafts, probs

    def _chain(self, anchor: int, draft: Draft):
        """The chain's drafts [Q - 1] and, sampling, the distributions they were drawn from."""
        cfg = self.config
        if cfg.temperature > 0 and self.selector is not None:
            return sample_selector_path(self.selector, draft, anchor, cfg.temperature, self.generator)
        if cfg.temperature > 0 and self.kind.sample_path is not None:  # DSpark: each draw biased by the one before
            return self.kind.sample_path(self.drafter, draft.logits, anchor, self._probs, self.generator)
        if cfg.temperature > 0:
            probs = self._probs(draft.logits)
            return torch.multinomial(probs, 1, generator=self.generator)[:, 0], probs
        return draft.tokens, None

    def _verify(self, anchor: int, candidates, draft_probs) -> tuple[DraftTree, list[int], int, torch.Tensor]:
        """One target forward over the candidates; (the round's tree, accepted path of node indices, the next
        token, the features of every node). A greedy round reads the device once, after the forward."""
        if isinstance(candidates, DraftTree):
            tree = candidates
            logits, features = self.verifier.forward(*tree.tensors("cpu"), pad_to=self.config.tree_budget)
            path, bonus = greedy_accept(tree.tokens, tree.parents, logits.argmax(dim=-1).tolist())
            return tree, path, bonus, features
        drafts = candidates
        logits, features = self.verifier.forward(torch.cat([drafts.new_full((1,), anchor), drafts]))
        if draft_probs is not None:
            accepted, bonus = sampled_accept_chain(drafts, draft_probs, self._probs(logits), self.generator)
            return DraftTree.chain(anchor, drafts.tolist()), list(range(accepted + 1)), bonus, features
        values = torch.cat([drafts, logits.argmax(dim=-1)]).tolist()
        tree = DraftTree.chain(anchor, values[:len(drafts)])
        path, bonus = greedy_accept(tree.tokens, tree.parents, values[len(drafts):])
        return tree, path, bonus, features

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                 confidence_threshold: float | None = None) -> GenerationResult:
        """Speculative decoding of one prompt (max_new_tokens: at most the config's, which sized the caches;
        confidence_threshold: this run's, None for the config's)."""
        from transformers import DynamicCache

        cfg = self.config
        new_tokens_limit = min(max_new_tokens or cfg.max_new_tokens, cfg.max_new_tokens)
        threshold = cfg.confidence_threshold if confidence_threshold is None else confidence_threshold
        first, _, context, prefill_s = self._prefill(prompt_ids)
        result = GenerationResult(len(prompt_ids), [first], prefill_s=prefill_s)
        draft_cache = None
        if self.static_drafter is None:  # static_draft=False: a growing cache, cropped back to the anchor
            draft_cache = DynamicCache(config=self.drafter.config)
            if hasattr(draft_cache, "activate_past_recording"):
                draft_cache.activate_past_recording()  # sliding drafter layers must be croppable
        stop = set(cfg.stop_token_ids)
        max_length = len(prompt_ids) + new_tokens_limit
        start = len(prompt_ids)  # position of the anchor (the last token, not yet in the target cache)
        events = self._events
        decode_start = time.perf_counter()
        while start + 1 < max_length and result.tokens[-1] not in stop:
            size = min(self.block_size, max_length - start)  # >= 2 here
            anchor = result.tokens[-1]
            t0 = time.perf_counter()
            if events:
                events[0].record()
            candidates, draft_probs = self._propose(anchor, self._draft(anchor, context, draft_cache, start, size),
                                                    threshold)
            if events:
                events[1].record()
            t1 = time.perf_counter()
            tree, path, bonus, features = self._verify(anchor, candidates, draft_probs)
            produced = min(len(path), max_length - start - 1)
            new_tokens = ([tree.tokens[i] for i in path[1:]] + [bonus])[:produced]
            for i, token in enumerate(new_tokens):
                if token in stop:
                    produced, new_tokens = i + 1, new_tokens[:i + 1]
                    break
            kept = self.verifier.commit(path[:produced])  # device indices when the kept nodes moved
            context = features[:produced] if kept is None else features.index_select(0, kept)
            round_s = time.perf_counter() - t0
            if events:  # the drafter's share, timed on the device (both events ran: _verify has read a result)
                t1 = t0 + events[0].elapsed_time(events[1]) / 1e3
            result.draft_s += t1 - t0
            result.verify_s += round_s - (t1 - t0)
            result.tokens.extend(new_tokens)
            result.acceptance_lengths.append(produced)
            result.accepted_drafts.append(len(path) - 1)
            result.nodes_per_round.append(tree.num_nodes)
            result.drafts.append(tree.tokens[1:])
            start += produced
        _sync(self.device)
        result.decode_s = time.perf_counter() - decode_start
        return result

    def warm_up(self, prompt_ids: list[int]) -> None:
        """The prompt's prefill and first round, untimed: the eager steps whose shapes depend on the prompt (the
        prefill, the drafter's first pass over its features) pay their first-call costs here, before the timed
        runs that a speedup compares, so that neither the speculative nor the AR run carries them."""
        self.generate(prompt_ids, max_new_tokens=self.block_size + 1)

    def close(self) -> None:
        """Give the target back as it was: the verifier's hooks removed, its attention implementation restored."""
        self.verifier.close()

    def __enter__(self) -> "SpeculativeDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
