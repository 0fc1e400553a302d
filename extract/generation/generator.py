"""Fast local generation for ``dflashkit regenerate``: fixed batch slots over a static KV cache.

Design choices:
- The target stays the Hugging Face model: its own forward (rope, norms, MoE, attention sinks, sliding windows)
  runs every step. Only the cache and the attention function are ours (slot_cache.py). ``SlotCache`` holds, per
  layer, K and V of shape ``[slots, kv_heads, max_length, head_dim]``; a token's cache column is its position in
  its own sequence, so every slot has its own length and no slot is padded on the left.
- Each step passes an explicit boolean mask over the cache (``[slots, 1, 1, length]``: column <= the slot's
  position, and inside the window for ``sliding_attention`` layers) and explicit position ids. A decode step
  attends to the first ``length`` columns only: the smallest multiple of ``length_step`` above every live
  slot's position (one CUDA graph per length, all sharing one memory pool).
- Decode attention treats each K/V head's group of query heads as its queries (GQA without repeating K/V):
  one fused SDPA call; our own float32-softmax form where the layer has attention sinks or soft-capping.
  Prefill uses the library's SDPA (the grouped form for sinks).
- ``decode_attention="triton"`` (the default; it runs on a GPU with Triton): decode steps of layers without
  sinks or soft-capping run the flash-decoding kernel of decode_attention.py instead, which reads each slot's
  columns up to its own position (the positions reach it as the model's ``slot_decode`` keyword, which the
  forward hands to every attention call), so a step reads the live lengths rather than every slot up to the
  longest one; a free slot (waiting for a refill, or done at the end of a run) reads one column (its speed-up
  on an H200: bench/bench_regenerate.py measures it). Elsewhere
  (CPU, no Triton), and for a model whose layers all have sinks or soft-capping, the SDPA path runs; "sdpa"
  asks for it everywhere.
- Prompts are prefilled in length buckets (longest first, left padding, rows rolled into cache columns 0..L-1),
  and a finished slot is refilled with the next prompt (continuous batching). Refills wait until an eighth of
  the slots is free (or none is decoding), so prefills come in batches rather than one prompt at a time.
- ``follow_up`` lets a finished request queue the next one (a conversation's next turn, its answer in the
  history): multi-turn data then streams through the slots instead of advancing in rounds of one turn, where the
  last rounds would decode a few long conversations in otherwise idle slots. The follow-ups run on the host
  right after a decode step is launched, so tokenizing the next turn overlaps the GPU's work.
- The decode step (forward, sampling, position update) is one function. On a GPU it is captured as a CUDA
  graph (per attended length) and replayed; on the CPU (and where capture fails, e.g. data-dependent MoE
  routing) the same function runs eagerly, so the CPU tests cover the captured maths.
- Sampling (temperature, top-k, top-p; an exponential-race draw from the default generator, seeded per call;
  greedy: the argmax of float32 logits) is the target runtime's (dflashkit/targets/runtime/sampling.py).
- Targets with recurrent layers (linear attention: Qwen3.5, Qwen3-Next) have state that is not a K/V cache;
  ``attention_only`` (targets/runtime/parts.py) says no for them and ``regenerate`` uses Hugging Face
  ``generate`` instead.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dflashkit.errors import UserError
from dflashkit.targets.loading import cache_kwargs, target_parts
from dflashkit.targets.runtime.graphs import capture_graph
from dflashkit.targets.runtime.kernels import triton_available
from dflashkit.targets.runtime.parts import attention_only, layer_types
from dflashkit.targets.runtime.sampling import sample_next
from dflashkit.targets.runtime.static_cache import AttentionSwitch

from .slot_cache import ATTENTION_NAME, SlotCache, SlotDecode, register_slot_attention

# ---------------------------------------------------------------- the generator


class SlotGenerator:
    """Continuous-batching generation over `num_slots` static cache rows (see the module docstring)."""

    def __init__(self, target, stop_ids: list[int], num_slots: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, cuda_graph: bool = True, prefill_tokens: int = 32768,
                 length_step: int = 128, decode_attention: str = "triton"):
        if decode_attention not in ("sdpa", "triton"):
            raise ValueError(f"decode_attention={decode_attention!r}: give 'sdpa' or 'triton'")
        if num_slots < 1 or length_step < 1 or prefill_tokens < 1:
            raise ValueError(f"num_slots ({num_slots}), length_step ({length_step}) and prefill_tokens "
                             f"({prefill_tokens}) must be >= 1")
        parts = target_parts(target)  # a Target, or a bare HF model
        model = parts.model
        if not attention_only(parts):
            raise UserError(f"{type(model).__name__} has non-attention layers (linear attention); use Hugging "
                            "Face generate for it")
        register_slot_attention()
        self.model, self.stop_ids, self.num_slots = model, set(stop_ids), num_slots
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.prefill_tokens = prefill_tokens  # padded prompt tokens per prefill forward
        self.length_step = length_step  # cache length and attended lengths are multiples of it (one graph each)
        self.device = next(model.parameters()).device
        self.dtype = parts.embed_tokens.weight.dtype  # the activations' dtype
        types = layer_types(parts.config)
        window = getattr(parts.config, "sliding_window", None)
        self.window = int(window) if ("sliding_attention" in types and window) else None
        self.layer_windows = tuple(self.window if t == "sliding_attention" else None for t in types)
        # the kernel where it can run (a GPU; any device under TRITON_INTERPRET=1), else the SDPA path
        self.decode_attention = "triton" if decode_attention == "triton" and triton_available(self.device) else "sdpa"
        self.kernel_layers = 0  # how many layers the last traced decode step ran through the kernel
        self.use_graph = cuda_graph and self.device.type == "cuda"
        if self.device.type == "cuda":  # graphs and streams are made on the current device: make it the model's
            torch.cuda.set_device(self.device)
        self.graphed = False  # True once a decode step has been captured as a CUDA graph
        # per generate() call: decode steps, prefill forwards, slot-steps left idle while prompts waited
        self.stats = {"decode_steps": 0, "prefills": 0, "idle_slot_steps_waiting": 0}
        self.cache: SlotCache | None = None
        self._graphs: dict[int, object] = {}  # attended length -> captured decode step
        self._pool = None  # the graphs share one memory pool
        self._attention = AttentionSwitch(model)  # our attention function for our forwards only
        self.tok = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # the token each slot feeds next
        self.pos = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # its position (= cache column)
        # which slots hold a request (the decode kernel reads one column of the others; the SDPA path ignores it)
        self.live = torch.ones(num_slots, dtype=torch.bool, device=self.device)

    # ---- masks: True where a query may read a key
    def _masks(self, allowed_full: torch.Tensor, allowed_window: torch.Tensor | None):
        if self.window is None:
            return allowed_full
        return {"full_attention": allowed_full, "sliding_attention": allowed_window}

    def _forward(self, input_ids, position_ids, mask, **attention_kwargs):
        # the model is shared (e.g. with Hugging Face generate), so the switch lasts for one forward only
        previous = self._attention.set(ATTENTION_NAME)
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                             logits_to_keep=1, **cache_kwargs(self.model, self.cache), **attention_kwargs)
        finally:
            self._attention.set(previous)
        return out.logits[:, -1]

    # ---- the decode step: the function the CUDA graph captures
    def _decode_step(self, length: int) -> None:
        """One token per slot; attention over cache columns 0..length-1 (above every live slot's position)."""
        columns = self.pos.clamp(max=length - 1)  # an idle slot rewrites a column of its own row, read by no one
        cols = torch.arange(length, device=self.device)[None, :]
        full = cols <= columns[:, None]
        window = (full & (cols > columns[:, None] - self.window)) if self.window else None
        self.cache.decode(columns, length)
        # additive masks, made once per step (SDPA would convert a boolean one in every layer)
        full, window = (None if m is None else torch.zeros(m.shape, dtype=self.dtype, device=self.device)
                        .masked_fill_(~m, float("-inf"))[:, None, None, :] for m in (full, window))
        mask = self._masks(full, window)  # still made: layers with sinks or soft-capping read it
        extra = {}
        if self.decode_attention == "triton":  # a free slot reads column 0 only (its token is never used)
            extra["slot_decode"] = SlotDecode(torch.where(self.live, columns, 0), self.layer_windows, set())
        logits = self._forward(self.tok[:, None], columns[:, None], mask, **extra)
        if extra:
            self.kernel_layers = len(extra["slot_decode"].kernel_layers)
            if not self.kernel_layers:  # every layer has sinks or soft-capping, or the forward drops the keyword
                print(f"generator: no layer of {type(self.model).__name__} ran the decode kernel; decoding with "
                      "SDPA", file=sys.stderr)
                self.decode_attention = "sdpa"
        self.tok.copy_(sample_next(logits, self.temperature, self.top_p, self.top_k))
        self.pos.copy_(columns + 1)

    def _step(self, length: int) -> None:
        if self.use_graph and length not in self._graphs:
            self._capture(length)
        if self.use_graph:
            self._graphs[length].replay()
        else:
            self._decode_step(length)

    def _capture(self, length: int) -> None:
        saved = (self.tok.clone(), self.pos.clone())
        try:
            graph, _ = capture_graph(lambda: self._decode_step(length), self.device, self._pool)
            self._pool = graph.pool()
            self._graphs[length], self.graphed = graph, True
        except RuntimeError as e:  # e.g. MoE routing that needs the host: run the same step eagerly
            print(f"generator: decode step not captured as a CUDA graph ({str(e).splitlines()[0]}); "
                  "running it eagerly", file=sys.stderr)
            self.use_graph = False
        # the warm-up steps wrote cache columns that no live slot reads (each is rewritten before it is
        # unmasked), and advanced tok/pos: restore them
        self.tok.copy_(saved[0])
        self.pos.copy_(saved[1])

    # ---- prefill a batch of prompts into the given slots; returns each one's first token
    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> list[int]:
        lengths = [len(p) for p in prompts]
        width = min(-(-max(lengths) // 16) * 16, self.cache.max_length)  # padded to 16: few distinct shapes
        n = len(prompts)
        ids = torch.zeros(n, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        shift = torch.tensor([width - n_ for n_ in lengths], dtype=torch.long, device=self.device)
        t = torch.arange(width, device=self.device)
        positions = (t[None, :] - shift[:, None]).clamp(min=0)
        q, k = t[:, None], t[None, :]
        real_key = k[None] >= shift[:, None, None]  # [n, 1 -> q, k]
        full = (k <= q)[None] & (real_key | (k == q)[None])  # a padding query sees itself only (no empty rows)
        window = None
        if self.window:
            window = full & ((q - k < self.window)[None] | (k == q)[None])
        self.cache.prefill(torch.tensor(slots, dtype=torch.long, device=self.device), shift)
        mask = self._masks(full[:, None], None if window is None else window[:, None])
        logits = self._forward(ids.to(self.device), positions, mask)
        first = sample_next(logits, self.temperature, self.top_p, self.top_k)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.tok[index] = first
        self.pos[index] = torch.tensor(lengths, dtype=torch.long, device=self.device)
        return first.tolist()

    @torch.inference_mode()
    def reserve(self, max_length: int) -> None:
        """Allocate the cache for sequences up to `max_length` tokens and, on a GPU, capture the decode step for
        every attended length now (generate() does both when first needed). Call it while no slot is busy."""
        self._ensure_cache(max_length)
        self._prefill([0], [[0]])  # allocates every layer's K/V (no slot is live: what it writes is never read)
        if self.use_graph:
            for length in range(self.length_step, self.cache.max_length + 1, self.length_step):
                if length not in self._graphs:
                    self._capture(length)

    def _ensure_cache(self, max_length: int) -> None:
        if self.cache is None or self.cache.max_length < max_length:
            self.cache = SlotCache(self.num_slots, -(-max_length // self.length_step) * self.length_step)
            self._graphs, self._pool = {}, None  # graphs hold the old cache's addresses

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int = 0, follow_up=None,
                 max_prompt_length: int = 0) -> list[list[int]]:
        """New tokens for each prompt (input order), cut before the first stop id, at most max_new_tokens.

        ``follow_up(r, tokens)``, if given, is called once request ``r`` has finished with its new ``tokens``; a
        prompt it returns joins the queue as request ``len(prompts)`` (the list grows; outputs follow it), so a
        conversation's next turn starts as soon as its previous answer ends. On a GPU the calls run while the
        next decode step computes. ``max_prompt_length``: the longest prompt a follow-up may return (the cache
        is sized once, for it and the given prompts).

        The host keeps per-slot counters in numpy and each step's tokens as one row of a history (``_Slots``); a
        request's answer is read out of its slot's column when it finishes, so a step costs the host
        O(finished) Python."""
        if not prompts:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: give at least 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("an empty prompt cannot be generated from")
        requests = _Requests(list(prompts), follow_up, max(max(len(p) for p in prompts), max_prompt_length))
        self._ensure_cache(requests.longest + max_new_tokens)
        torch.manual_seed(seed)
        self.stats = dict.fromkeys(self.stats, 0)
        slots = _Slots.empty(self.num_slots)
        stops = np.array(sorted(self.stop_ids) or [-1], dtype=np.int64)
        refill_at = max(1, self.num_slots // 8)
        while True:
            free = np.flatnonzero(slots.owner < 0)
            busy = self.num_slots - len(free)
            if requests.finished and busy == 0:
                requests.run_follow_ups()
            # refill once an eighth of the slots is free; with no follow-ups to come, also when the rest of the
            # queue fits (follow-ups keep the queue short: refilling for each would prefill a few at a time)
            queued = len(requests.queue)
            if queued and (len(free) >= refill_at or busy == 0 or (follow_up is None and len(free) >= queued)):
                self._refill(requests, slots, free[:queued].tolist(), max_new_tokens)
                continue
            if busy == 0:
                return requests.outputs
            if queued:
                self.stats["idle_slot_steps_waiting"] += len(free)
            self._decode_round(requests, slots, stops, max_new_tokens)

    def _refill(self, requests: _Requests, slots: _Slots, free: list[int], max_new_tokens: int) -> None:
        """Prefill the next queued prompts into the ``free`` slots, in length buckets: consecutive prompts (longest
        first) under the ``prefill_tokens`` budget per forward."""
        prompts = requests.prompts
        batch = sorted((requests.queue.popleft() for _ in free), key=lambda r: -len(prompts[r]))
        lo = 0
        while lo < len(batch):
            hi = lo + 1
            while hi < len(batch) and (hi + 1 - lo) * len(prompts[batch[lo]]) <= self.prefill_tokens:
                hi += 1
            bucket, reqs = free[lo:hi], batch[lo:hi]
            for s, r, token in zip(bucket, reqs, self._prefill(bucket, [prompts[r] for r in reqs])):
                slots.fill(s, r, token, len(prompts[r]))
                if token in self.stop_ids:
                    slots.owner[s] = -1
                    requests.finish(r, [])
                elif max_new_tokens == 1:
                    slots.owner[s] = -1
                    requests.finish(r, [token])
            self.stats["prefills"] += 1
            lo = hi

    def _decode_round(self, requests: _Requests, slots: _Slots, stops: np.ndarray, max_new_tokens: int) -> None:
        """One decode step of every live slot; the follow-ups of finished requests run while it computes; the
        requests that stop (a stop id, or max_new_tokens) give their answers and free their slots."""
        self.stats["decode_steps"] += 1
        live = slots.owner >= 0
        if self.decode_attention == "triton" and not np.array_equal(live, slots.sent_live):
            self.live.copy_(torch.from_numpy(live))
            slots.sent_live = live
        need = int((slots.prompt_len + slots.count - 1)[live].max()) + 1  # above the position every live slot feeds
        self._step(min(self.cache.max_length, -(-need // self.length_step) * self.length_step))
        if requests.finished:  # the step computes on the GPU meanwhile
            requests.run_follow_ups()
        tokens = slots.record(self.tok.cpu().numpy())
        slots.count[live] += 1
        stopped = live & np.isin(tokens, stops)
        for s in np.flatnonzero(stopped | (live & (slots.count >= max_new_tokens))).tolist():
            requests.finish(int(slots.owner[s]), slots.answer(s, bool(stopped[s])))
            slots.owner[s] = -1


# ---------------------------------------------------------------- one generate() call's host state


@dataclass
class _Requests:
    """The requests of one ``generate`` call: their prompts (follow-ups append to them), their outputs, the queue
    waiting for a slot (longest first), and the finished ones whose ``follow_up`` has not run yet."""

    prompts: list[list[int]]  # the call's prompts, then each follow-up's
    follow_up: Callable | None  # follow_up(r, tokens) -> the next prompt or None (see SlotGenerator.generate)
    longest: int  # the longest prompt the cache was sized for: a follow-up may not pass it
    outputs: list[list[int]] = field(init=False)  # per request, its new tokens
    queue: deque = field(init=False)  # requests waiting for a slot
    finished: list[int] = field(default_factory=list)  # requests done whose follow_up has not run yet

    def __post_init__(self):
        self.outputs = [[] for _ in self.prompts]
        self.queue = deque(sorted(range(len(self.prompts)), key=lambda i: -len(self.prompts[i])))

    def finish(self, r: int, tokens: list[int]) -> None:
        self.outputs[r] = tokens
        if self.follow_up is not None:
            self.finished.append(r)

    def run_follow_ups(self) -> None:
        """Ask ``follow_up`` for the next prompt of each finished request; a prompt joins the queue."""
        for r in self.finished:
            prompt = self.follow_up(r, self.outputs[r])
            if prompt is None:
                continue
            if not 0 < len(prompt) <= self.longest:
                raise ValueError(f"follow_up gave a prompt of {len(prompt)} tokens; give 1..{self.longest} "
                                 "(max_prompt_length)")
            self.prompts.append(prompt)
            self.outputs.append([])
            self.queue.append(len(self.prompts) - 1)
        self.finished.clear()


@dataclass
class _Slots:
    """Per-slot host counters of one ``generate`` call (numpy), and every decode step's tokens as one row of
    ``history``: a finished request's answer is read out of its slot's column."""

    owner: np.ndarray  # request per slot, -1: free
    count: np.ndarray  # tokens its request has so far (the prefill's first included)
    first: np.ndarray  # that first token (from the prefill)
    start: np.ndarray  # the history row of its first decode step
    prompt_len: np.ndarray  # its prompt's length
    history: np.ndarray  # history[step] = every slot's token of that step (doubled when full)
    step: int = 0  # decode steps taken: the next row of history
    sent_live: np.ndarray | None = None  # the live slots SlotGenerator.live holds (the decode kernel's)

    @classmethod
    def empty(cls, n_slots: int) -> _Slots:
        return cls(np.full(n_slots, -1, dtype=np.int64), *(np.zeros(n_slots, dtype=np.int64) for _ in range(4)),
                   np.zeros((256, n_slots), dtype=np.int64))

    def fill(self, s: int, r: int, token: int, prompt_len: int) -> None:
        """Slot ``s`` now holds request ``r``, prefilled: ``token`` is its first new token."""
        self.owner[s], self.count[s], self.first[s] = r, 1, token
        self.start[s], self.prompt_len[s] = self.step, prompt_len

    def record(self, tokens: np.ndarray) -> np.ndarray:
        """Keep one decode step's tokens (one per slot) as the next row of history."""
        if self.step == len(self.history):
            self.history = np.concatenate([self.history, np.zeros_like(self.history)])
        self.history[self.step] = tokens
        self.step += 1
        return tokens

    def answer(self, s: int, stopped: bool) -> list[int]:
        """The new tokens of slot ``s``'s request: its first, then its column of history (without the stop id)."""
        column = self.history[self.start[s]:self.step, s].tolist()
        return [int(self.first[s])] + (column[:-1] if stopped else column)
