"""Live speculative decoding of a target with a DFlash drafter: the round loop, and the autoregressive baseline.

One round (batch 1, as the reference `dflash_generate`):
  1. the drafter sees the new context features (the target layer outputs of the tokens accepted last round) and
     the block [anchor, MASK x (B-1)]; it keeps its own DynamicCache of context K/V, cropped back to the anchor;
  2. chain: argmax (or a sample) per draft position; tree: best-first top-k tree up to the node budget;
  3. one target forward over all candidate nodes (tree attention, positions = prefix length + depth);
  4. accept the longest path the target agrees with, plus the bonus token (eval/acceptance.py);
  5. keep only the accepted nodes' K/V (compaction) and pass their features on as the next context.
Lengths and stopping follow the reference exactly (a round produces min(accepted + 1, room left) tokens, the
last block shrinks to the room left, a stop token ends the sequence and counts), so acceptance lengths can be
compared round by round. The baseline runs the same verifier one token per step: the same harness.
On CUDA the target's steps after the prefill (AR step, chain block, tree padded to the budget; eval/verifier.py)
and the drafter's pass (eval/draft_step.py) replay CUDA graphs, captured once per shape on static caches
(`cuda_graphs=False` for eager); the CPU runs the same code eagerly. Drafters with sliding-window layers keep a
transformers DynamicCache, cropped back to the anchor, eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .acceptance import greedy_accept, sampled_accept_chain, sampling_probs
from .draft_step import StaticDrafter, supports_static_steps
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
    seed: int = 0  # sampling generator seed (reset per prompt)

    def check(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"mode must be 'chain' or 'tree', got {self.mode!r}")
        if self.mode == "tree" and self.temperature > 0:
            raise ValueError("tree mode is greedy only; speculative sampling (--temperature > 0) runs on a chain "
                             "(--mode chain)")
        if self.temperature < 0 or self.max_new_tokens < 1 or self.tree_budget < 1 or self.tree_top_k < 1:
            raise ValueError("temperature must be >= 0, max_new_tokens, tree_budget and tree_top_k >= 1")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"top_p must be in (0, 1] and top_k >= 0 (0 = off), got {self.top_p}, {self.top_k}")


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
    draft_s: float = 0.0  # drafter passes (speculative runs)
    verify_s: float = 0.0  # target forwards after the prefill incl. commit (AR: the steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _crop(cache, length: int) -> None:
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class SpeculativeDecoder:
    """Target + drafter. `generate(prompt_ids)` decodes speculatively; `generate_autoregressive` is the baseline."""

    def __init__(self, target, drafter: nn.Module, config: DecodeConfig):
        config.check()
        self.model = target if isinstance(target, nn.Module) else target.model  # a CausalLM or a dflashkit Target
        self.drafter = drafter.eval()
        self.config = config
        self.block_size = config.block_size or drafter.block_size
        self.device = next(self.model.parameters()).device
        self.embed_weight = self.model.get_input_embeddings().weight
        self.lm_head = self.model.get_output_embeddings()
        self.embed_scale = float(getattr(drafter, "input_embedding_scale", 1.0))
        self.mask_token_id = int(drafter.mask_token_id)
        from .verifier import TargetVerifier, is_hybrid

        if is_hybrid(self.model):
            from .hybrid import TREE_REFUSAL, HybridChainVerifier

            if config.mode == "tree":
                raise ValueError(TREE_REFUSAL)
            self.verifier = HybridChainVerifier(self.model, drafter.target_layer_ids)
        else:
            self.verifier = TargetVerifier(self.model, drafter.target_layer_ids, config.attention_backend,
                                           config.cuda_graphs)
        self.generator = torch.Generator(device=self.device)
        self.static_drafter = None  # full-attention drafters: static context cache, CUDA graphs on CUDA
        if supports_static_steps(drafter):
            self.static_drafter = StaticDrafter(drafter, self.embed_weight, self.embed_scale, self.lm_head,
                                                self.mask_token_id, self.block_size,
                                                config.cuda_graphs and getattr(self.verifier, "cuda_graphs", True))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return sampling_probs(logits, cfg.temperature, cfg.top_p, cfg.top_k)

    def _pick(self, logits: torch.Tensor) -> int:
        if self.config.temperature > 0:
            return int(torch.multinomial(self._probs(logits), 1, generator=self.generator))
        return int(logits.argmax())

    def _prefill(self, prompt_ids: list[int]):
        cfg = self.config
        # the one place the caches are sized: prompt + new tokens + one round of nodes
        room = len(prompt_ids) + cfg.max_new_tokens + max(self.block_size, cfg.tree_budget) + 1
        self.verifier.reserve(room)
        if self.static_drafter is not None:
            self.static_drafter.reserve(room)
        self.verifier.reset()
        self.generator.manual_seed(cfg.seed)
        _sync(self.device)
        start = time.perf_counter()
        logits, features = self.verifier.forward(torch.tensor(prompt_ids, device=self.device),
                                                 last_logits_only=True)
        self.verifier.commit(list(range(len(prompt_ids))))
        first = self._pick(logits[-1])
        _sync(self.device)
        return first, features, time.perf_counter() - start

    @torch.inference_mode()
    def generate_autoregressive(self, prompt_ids: list[int]) -> GenerationResult:
        """Greedy (or sampled) decoding one token per target forward, through the same verifier."""
        first, _, prefill_s = self._prefill(prompt_ids)
        result = GenerationResult(len(prompt_ids), [first], prefill_s=prefill_s)
        stop = set(self.config.stop_token_ids)
        start = time.perf_counter()
        while len(result.tokens) < self.config.max_new_tokens and result.tokens[-1] not in stop:
            logits, _ = self.verifier.forward(torch.tensor([result.tokens[-1]], device=self.device))
            self.verifier.commit([0])
            result.tokens.append(self._pick(logits[-1]))
        _sync(self.device)
        result.decode_s = result.verify_s = time.perf_counter() - start
        return result

    def _draft(self, anchor: int, context: torch.Tensor, draft_cache, start: int, size: int) -> torch.Tensor:
        """Drafter logits [size - 1, V] for positions start+1 .. start+size-1."""
        if self.static_drafter is not None:
            return self.static_drafter.logits(anchor, context, start, size)
        block = torch.full((1, size), self.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor
        noise = F.embedding(block, self.embed_weight) * self.embed_scale
        positions = torch.arange(start - context.shape[0], start + size, device=self.device).unsqueeze(0)
        hidden = self.drafter(position_ids=positions, noise_embedding=noise.to(self.drafter.dtype),
                              target_hidden=context.unsqueeze(0).to(self.drafter.dtype),
                              past_key_values=draft_cache, use_cache=True)
        _crop(draft_cache, start)
        return self.drafter.compute_logits(hidden[:, 1 - size:, :].to(self.lm_head.weight.dtype), self.lm_head)[0]

    def _propose(self, anchor: int, draft_logits: torch.Tensor | None) -> tuple[DraftTree, torch.Tensor | None]:
        cfg = self.config
        if draft_logits is None:
            return DraftTree.chain(anchor, []), None
        if cfg.mode == "tree":
            return build_tree(anchor, draft_logits, cfg.tree_budget, cfg.tree_top_k), None
        if cfg.temperature > 0:
            probs = self._probs(draft_logits)
            drafts = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
            return DraftTree.chain(anchor, drafts.tolist()), probs
        return DraftTree.chain(anchor, draft_logits.argmax(dim=-1).tolist()), None

    def _accept(self, tree: DraftTree, logits: torch.Tensor, draft_probs) -> tuple[list[int], int]:
        if self.config.temperature > 0:
            drafts = torch.tensor(tree.tokens[1:], device=logits.device)
            accepted, next_token = sampled_accept_chain(
                drafts, draft_probs, self._probs(logits), self.generator)
            return list(range(accepted + 1)), next_token
        return greedy_accept(tree.tokens, tree.parents, logits.argmax(dim=-1).tolist())

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int]) -> GenerationResult:
        from transformers import DynamicCache

        cfg = self.config
        first, context, prefill_s = self._prefill(prompt_ids)
        result = GenerationResult(len(prompt_ids), [first], prefill_s=prefill_s)
        draft_cache = None
        if self.static_drafter is None:  # sliding-window drafters: a growing cache, cropped back to the anchor
            draft_cache = DynamicCache(config=self.drafter.config)
            if hasattr(draft_cache, "activate_past_recording"):
                draft_cache.activate_past_recording()  # sliding drafter layers must be croppable
        stop = set(cfg.stop_token_ids)
        max_length = len(prompt_ids) + cfg.max_new_tokens
        start = len(prompt_ids)  # position of the anchor (the last token, not yet in the target cache)
        decode_start = time.perf_counter()
        while start + 1 < max_length and result.tokens[-1] not in stop:
            size = min(self.block_size, max_length - start)
            anchor = result.tokens[-1]
            t0 = time.perf_counter()
            draft_logits = self._draft(anchor, context, draft_cache, start, size) if size > 1 else None
            tree, draft_probs = self._propose(anchor, draft_logits)
            _sync(self.device)
            t1 = time.perf_counter()
            tokens, parents, depths = tree.tensors("cpu")
            if cfg.mode == "tree":  # one shape per run: the tree padded to the budget
                logits, features = self.verifier.forward(tokens, parents, depths, pad_to=cfg.tree_budget)
            else:  # a chain block (shorter only at the end of the sequence)
                logits, features = self.verifier.forward(tokens)
            path, bonus = self._accept(tree, logits, draft_probs)
            produced = min(len(path), max_length - start - 1)
            new_tokens = ([tree.tokens[i] for i in path[1:]] + [bonus])[:produced]
            for i, token in enumerate(new_tokens):
                if token in stop:
                    produced, new_tokens = i + 1, new_tokens[:i + 1]
                    break
            self.verifier.commit(path[:produced])
            context = features[torch.tensor(path[:produced], device=features.device)]
            _sync(self.device)
            result.draft_s += t1 - t0
            result.verify_s += time.perf_counter() - t1
            result.tokens.extend(new_tokens)
            result.acceptance_lengths.append(produced)
            result.accepted_drafts.append(len(path) - 1)
            result.nodes_per_round.append(tree.num_nodes)
            result.drafts.append(tree.tokens[1:])
            start += produced
        result.decode_s = time.perf_counter() - decode_start
        return result

    def close(self) -> None:
        self.verifier.close()
