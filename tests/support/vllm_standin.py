"""A CPU twin of `vllm.LLM`: the calls and metric objects `dflashkit eval --engine vllm` uses, decoding for real.

vLLM does not run on a CPU, so the vLLM adapter (eval/vllm_engine.py over targets/vllm/) and bench/bench_vllm.py
run on one with this twin (the tests, and the lab's CPU toys: lab/standin_vllm_eval.py, lab/standin_bench_vllm.py);
the GPU run proves the real path. A test double: nothing of the product imports it.

Design choices:
- ``LLM(model=DIR, speculative_config={"method": "dflash", "model": DRAFTER, "num_speculative_tokens": N})``:
  the target loads with dflashkit's loader (fp32, CPU). ``generate`` decodes every prompt greedily, with a drafter
  through dflashkit's chain decoder with blocks of N + 1 (eval/decoder.py, eval/acceptance.py: the acceptance
  counts are what this drafter really gets accepted), without one autoregressively through the same verifier.
- ``get_metrics`` returns objects shaped like vllm.v1.metrics.reader's ``Counter`` and ``Vector``, with vLLM's names
  and one label set per engine: ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
  ``..._num_accepted_tokens`` and the per-position vector ``..._num_accepted_tokens_per_pos`` (N entries),
  only when a drafter is configured, as vLLM registers them (v1/spec_decode/metrics.py).
- Time is modelled, not measured (``ModelledClock``, ``StepCost``): an engine step costs a fixed part (the
  weights read once per step, whatever the batch) plus a part per token it queries; with a drafter each step
  also pays the drafter's pass. The requests of one ``generate`` call are batched step by step as a
  continuous-batching engine batches them (at most ``max_num_seqs`` at once; a new request's prefill joins the
  next step). Throughput, TTFT and inter-token latency therefore follow from the real acceptance and the batch
  size, identically on every machine: speculation gains while steps are dominated by the fixed part (few
  requests) and loses once they are dominated by the 1 + N tokens each request queries (many requests). A
  decode step of more tokens than the CUDA-graph ceiling (``max_cudagraph_capture_size`` when given, else vLLM
  0.24's default, drafter/vllm_rules.py rule "cudagraph_ceiling") runs eagerly and pays ``eager_s`` more.
- ``RequestOutput.metrics`` carries the fields of vLLM's RequestStateStats that the adapter reads
  (``first_token_latency``, ``first_token_ts``, ``last_token_ts``, ``num_generation_tokens``).
- Prefix caching (on by default, as in vLLM): the prompt tokens an earlier prompt of the same engine began with
  are not charged in the prefill (``num_cached_tokens``). Acceptance is the decoder's either way.
- ``"method": "ngram"`` (vLLM's prompt lookup): the request's greedy tokens are decoded once; at each step the
  last ``prompt_lookup_max`` … ``prompt_lookup_min`` tokens are looked up in the request's earlier tokens and the
  (up to N) tokens that followed the latest match are proposed; the accepted ones are those equal to the greedy
  continuation, which is what verification accepts. Its proposals cost no modelled time (vLLM runs them on the host).
- ``num_speculative_tokens_per_batch_size`` (the per-batch-size schedule, expanded as vLLM expands it:
  eval/serving_plan.py ``schedule_lookup``): each step takes the k of its number of decoding requests. A dflash
  request is decoded once per k of the schedule (blocks of k + 1); a step at k advances it to the end of the
  round of that decode which covers its position: exact while a request's k does not change, a model of the
  rounds when it does (the counters then count what the step advanced). At k = 0 a step queries one token and
  still pays the drafter's pass (vLLM 0.24's V1 proposer runs it over that token to keep the drafter's cache
  filled; 0.26 drafts N and keeps the first k, so its pass fills 1 + N tokens at every k: drafter/vllm_rules.py
  rule "zero_k_range", ``draft_queries``).
- One release at a time (``version``, default ``VERSION``: 0.26, the engine the project serves with; 0.24 for
  side-by-side checks), following its row of drafter/vllm_rules.py ``VLLM_RULES``: on 0.24 every drafter layer is
  full attention (non-causal unless the drafter is causal in the block), so a sliding-window drafter is served
  unlike its training; on 0.26 as trained. The model runner (``model_runner``, recorded, not modelled) is V2
  unless ``VLLM_USE_V2_MODEL_RUNNER=0``, and on 0.24 V1 for a schedule; on 0.26 a drafter mixing sliding and
  full layers is refused on V1 (ValueError), as vLLM refuses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .vllm_capture_standin import CompletionOutput, RequestOutput  # vllm.outputs twins

VERSION = "0.26.0"  # the vLLM release the twin follows unless told another (LLM's ``version``)
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Counter:  # vllm.v1.metrics.reader.Counter
    name: str
    labels: dict[str, str]
    value: int


@dataclass
class Vector:  # vllm.v1.metrics.reader.Vector (only vllm:spec_decode_num_accepted_tokens_per_pos)
    name: str
    labels: dict[str, str]
    values: list[int]


@dataclass
class SamplingParams:  # the fields of vllm.SamplingParams the adapter sets
    max_tokens: int = 16  # new tokens per request
    temperature: float = 0.0  # only 0 (greedy) is modelled
    stop_token_ids: list[int] | None = None  # a request ends after one of these (kept)
    ignore_eos: bool = False  # True: only max_tokens ends a request


@dataclass
class RequestStateStats:  # vllm.v1.metrics.stats.RequestStateStats
    num_generation_tokens: int = 0  # tokens the request produced
    arrival_time: float = 0.0  # when generate() received it
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0  # when its prefill step began
    first_token_ts: float = 0.0  # end of the step that produced its first token
    last_token_ts: float = 0.0  # end of the step that produced its last token
    first_token_latency: float = 0.0  # first_token_ts - arrival_time


class ModelledClock:
    """Seconds of modelled engine time; pass the same clock to the engine and to whoever times it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class StepCost:
    fixed_s: float = 0.010  # per engine step: the target's weights read once, whatever the batch
    per_token_s: float = 0.0001  # per token the step queries (prefill tokens, 1 per AR request, 1 + N per draft)
    draft_fixed_s: float = 0.0005  # per step with a drafter: its weights read once
    draft_per_token_s: float = 0.00003  # per block token the drafter fills (N + 1 per decoding request)
    eager_s: float = 0.005  # per decoding step above the CUDA-graph ceiling: the launches a graph would have saved


@dataclass
class _Request:
    index: int
    prompt: list[int]
    tokens: list[int]  # the decoded output
    rounds: dict[int, list[tuple[int, int]]]  # k -> per round of the decode at k: (tokens produced, drafts accepted)
    ngram: tuple[int, int] | None = None  # (prompt_lookup_min, prompt_lookup_max) for "method": "ngram"
    cached: int = 0  # prompt tokens found in the prefix cache
    position: int = 1  # output tokens produced (the first comes from the prefill)
    stats: RequestStateStats = field(default_factory=RequestStateStats)

    @property
    def done(self) -> bool:
        return self.position >= len(self.tokens)

    def advance(self, k: int) -> tuple[int, int]:
        """(tokens this step produces, drafts accepted) for a step that drafts k tokens."""
        left = len(self.tokens) - self.position
        if k == 0:
            return 1, 0
        if self.ngram is not None:
            accepted = ngram_accepted(self.prompt + self.tokens, len(self.prompt) + self.position, k, *self.ngram)
            return min(accepted + 1, left), accepted
        start = 1
        for produced, accepted in self.rounds[k]:  # the round of the decode at k that covers this position
            if start + produced > self.position:
                if start == self.position:
                    return min(produced, left), accepted
                return start + produced - self.position, start + produced - self.position - 1
            start += produced
        return 1, 0


def ngram_accepted(sequence: list[int], position: int, k: int, lookup_min: int, lookup_max: int) -> int:
    """Drafts a prompt-lookup proposer gets accepted at ``position`` of ``sequence`` (the greedy tokens): the
    longest n-gram (lookup_max … lookup_min) ending there that occurred earlier, its latest occurrence's next k
    tokens proposed, counted while they equal the tokens that really follow."""
    context = sequence[:position]
    for n in range(min(lookup_max, len(context) - 1), lookup_min - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                proposal = context[start + n:start + n + k]
                accepted = 0
                while accepted < len(proposal) and position + accepted < len(sequence) \
                        and proposal[accepted] == sequence[position + accepted]:
                    accepted += 1
                return accepted
    return 0


def served_drafter(drafter, version: str, model_runner: str):
    """The drafter as vLLM ``version`` runs it (drafter/vllm_rules.py rules "sliding_window", "mixed_layers"): on
    0.24 every layer full attention, causal only when the drafter is causal in the block; on 0.26 as trained, and
    a drafter mixing sliding and full layers refused on the V1 runner."""
    from dflashkit.drafter import vllm_rules as rules

    layers = [layer.self_attn for layer in getattr(drafter, "layers", []) if hasattr(layer, "self_attn")]
    types = [attn.layer_type for attn in layers]
    if rules.serves_sliding_window(version):
        if rules.is_mixed_layers(types) and model_runner == "v1":
            raise ValueError(f"vLLM {version}: a DFlash drafter mixing sliding and full attention layers needs the "
                             f"V2 model runner ({rules.vllm_rule('mixed_layers', version)[1]})")
        return drafter
    causal = bool(getattr(drafter.config, "is_causal", None))  # dflash_config.causal: an export writes both
    for attn in layers:
        attn.layer_type, attn.sliding_window, attn.is_causal = "full_attention", None, causal
    return drafter


class _EngineObject:  # a vLLM config object: not JSON
    def __init__(self, kind: str):
        self.kind = kind


class LLM:
    """``vllm.LLM`` on the CPU (see the module docstring); engine arguments it does not model are recorded."""

    def __init__(self, model: str, *, speculative_config: dict | None = None, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, disable_log_stats: bool = True, clock: ModelledClock | None = None,
                 cost: StepCost | None = None, version: str = VERSION, **engine_kwargs):
        from dflashkit.targets.loading import load_target

        self.model = str(model)
        self.target = load_target(model)
        self.engine_kwargs = engine_kwargs  # dtype, max_model_len, gpu_memory_utilization, ...: not modelled
        self.version = version
        # the model runner vLLM would pick from VLLM_USE_V2_MODEL_RUNNER (recorded, not modelled); a schedule may
        # change it (``_speculation``)
        self.model_runner = "v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "v2"
        graphs = (engine_kwargs.get("compilation_config") or {}).get("max_cudagraph_capture_size")
        self._graph_ceiling = None if engine_kwargs.get("enforce_eager") else graphs
        self.prefix_caching = bool(enable_prefix_caching)
        self.max_num_seqs = int(max_num_seqs)
        self.log_stats = not disable_log_stats
        self.clock = clock or ModelledClock()
        self.cost = cost or StepCost()
        self.num_speculative_tokens = 0
        self.drafter = None
        self.method = None
        self.ngram: tuple[int, int] | None = None
        self.lookup: list[int] | None = None  # batch size -> k (a per-batch-size schedule)
        if speculative_config is not None:
            self._speculation(dict(speculative_config))
            # vLLM 0.24 adds its config objects to the caller's dict (vllm/engine/arg_utils.py
            # create_speculative_config); the twin does the same, so a caller that keeps the dict fails here too
            speculative_config.update({"target_model_config": _EngineObject("ModelConfig"),
                                       "target_parallel_config": _EngineObject("ParallelConfig")})
        self._seen: list[list[int]] = []  # prompts of this engine (the prefix cache)
        self._decoded: dict[tuple, object] = {}  # (prompt, max_tokens, stop ids) -> its GenerationResult
        self._counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0,
                        "per_pos": [0] * self.num_speculative_tokens}
        self._labels = {"engine": "0", "model_name": self.model}

    def _speculation(self, spec: dict) -> None:
        from dflashkit.eval.serving_plan import schedule_lookup

        self.method = spec.get("method")
        if self.method not in ("dflash", "ngram"):
            raise ValueError(f"speculative_config method {self.method!r}: the CPU twin models dflash and ngram")
        self.num_speculative_tokens = int(spec["num_speculative_tokens"])
        if self.method == "dflash":
            from dflashkit.drafter import load_drafter

            self.drafter = served_drafter(load_drafter(spec["model"]), self.version, self.model_runner)
        else:
            low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
            self.ngram = (int(low or high or 5), int(high or low or 5))  # vLLM's defaults (config/speculative.py)
        if spec.get("num_speculative_tokens_per_batch_size") is not None:
            self.lookup = schedule_lookup(spec["num_speculative_tokens_per_batch_size"], self.max_num_seqs,
                                          self.num_speculative_tokens)
            from dflashkit.drafter.vllm_rules import schedule_runner

            if schedule_runner(self.version) == "v1":  # 0.24: V2 does not serve a schedule
                self.model_runner = "v1"

    # ------------------------------------------------------------------ decoding
    def _ks(self) -> list[int]:
        """The k a step of this engine may draft (0: none)."""
        if self.method is None:
            return [0]
        return sorted(set(self.lookup[1:])) if self.lookup else [self.num_speculative_tokens]

    def _decoder(self, max_tokens: int, stop: tuple[int, ...], k: int):
        from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder

        drafting = self.drafter is not None and k > 0
        config = DecodeConfig(block_size=k + 1 if drafting else None, max_new_tokens=max_tokens,
                              stop_token_ids=stop, cuda_graphs=False, static_draft=drafting)
        return SpeculativeDecoder(self.target.model, self.drafter if drafting else _NoDrafter(), config)

    def _decode(self, decoders: dict, prompt: list[int], key: tuple) -> tuple[list[int], dict]:
        """The greedy tokens and, for each k a dflash step may draft, the rounds of the decode at k."""
        rounds = {}
        for k, decoder in decoders.items():
            if (key, k) not in self._decoded:  # greedy decoding is deterministic: a repeated request decodes once
                self._decoded[(key, k)] = (decoder.generate(prompt) if self.drafter is not None and k > 0
                                           else decoder.generate_autoregressive(prompt))
            result = self._decoded[(key, k)]
            rounds[k] = list(zip(result.acceptance_lengths, result.accepted_drafts))
        return result.tokens, rounds

    def reset_prefix_cache(self) -> bool:
        """vLLM's LLM.reset_prefix_cache: forget every cached prompt."""
        self._seen.clear()
        return True

    def _cached_prefix(self, prompt: list[int]) -> int:
        best = 0
        for seen in self._seen if self.prefix_caching else []:
            n = 0
            while n < min(len(seen), len(prompt) - 1) and seen[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    def generate(self, prompts, sampling_params: SamplingParams | None = None, *, use_tqdm=False,
                 **_ignored) -> list[RequestOutput]:
        import torch

        from dflashkit.eval.run import stop_ids

        params = sampling_params or SamplingParams()
        if params.temperature:
            raise ValueError("the CPU twin of vllm.LLM decodes greedily only (temperature 0)")
        prompts = [prompts] if isinstance(prompts, dict) else list(prompts)
        ids = [list(p["prompt_token_ids"]) for p in prompts]
        stop = tuple(sorted(set(params.stop_token_ids or ())
                            | (set() if params.ignore_eos else set(stop_ids(self.target)))))
        ks = [k for k in self._ks() if k > 0 and self.drafter is not None] or [0]
        decoders = {k: self._decoder(params.max_tokens, stop, k) for k in ks}
        requests = []
        with torch.inference_mode():
            for i, prompt in enumerate(ids):
                tokens, rounds = self._decode(decoders, prompt, (tuple(prompt), params.max_tokens, stop))
                requests.append(_Request(i, prompt, tokens, rounds, self.ngram))
        for decoder in decoders.values():
            decoder.close()
        self._schedule(requests)
        return [RequestOutput(str(r.index), r.prompt, [CompletionOutput(0, "", r.tokens, "stop")],
                              metrics=r.stats if self.log_stats else None, num_cached_tokens=r.cached)
                for r in requests]

    def _schedule(self, requests: list[_Request]) -> None:
        """Advance the clock step by step as a continuous-batching engine would run these requests."""
        cost, clock = self.cost, self.clock
        arrival = clock()
        waiting, running = list(requests), []
        for r in requests:
            r.stats.arrival_time = r.stats.queued_ts = arrival
        while waiting or running:
            joining = waiting[:max(self.max_num_seqs - len(running), 0)]
            waiting = waiting[len(joining):]
            tokens = 0
            for r in joining:
                r.cached = self._cached_prefix(r.prompt)
                self._seen.append(r.prompt)
                tokens += len(r.prompt) - r.cached
                r.stats.scheduled_ts = clock()
            decoding = [r for r in running if not r.done]
            k = self.step_k(len(decoding))
            tokens += (1 + k) * len(decoding)
            step = cost.fixed_s + cost.per_token_s * tokens
            if self.drafter is not None and decoding:
                step += cost.draft_fixed_s + cost.draft_per_token_s * self.draft_queries(k) * len(decoding)
            if decoding and not joining and tokens > self.graph_ceiling:  # a pure decode step run eagerly
                step += cost.eager_s
            clock.advance(step)
            for r in joining:
                r.stats.first_token_ts = r.stats.last_token_ts = clock()
                r.stats.first_token_latency = clock() - r.stats.arrival_time
                r.stats.num_generation_tokens = 1
            for r in decoding:
                produced, accepted = r.advance(k)
                self._count(k, accepted)
                r.position += produced
                r.stats.num_generation_tokens += produced
                r.stats.last_token_ts = clock()
            running = [r for r in running + joining if not r.done]

    @property
    def graph_ceiling(self) -> int:
        """The most tokens a step runs inside CUDA graphs: max_cudagraph_capture_size when given, else vLLM 0.24's
        default min(max_num_seqs * (1 + num_speculative_tokens) * 2, 512) (drafter/vllm_rules.py rule
        "cudagraph_ceiling"); 0 with enforce_eager (every step eager)."""
        if self._graph_ceiling is not None:
            return self._graph_ceiling
        if self.engine_kwargs.get("enforce_eager"):
            return 0
        from dflashkit.drafter.vllm_rules import VLLM_DEFAULT_CUDAGRAPH_CEILING

        return min(self.max_num_seqs * (1 + self.num_speculative_tokens) * 2, VLLM_DEFAULT_CUDAGRAPH_CEILING)

    def draft_queries(self, k: int) -> int:
        """Block tokens a dflash drafter fills per request in a step that keeps k drafts: 1 + k where the drafter
        drafts the step's k (a fixed k; vLLM 0.24's V1 proposer with a schedule), 1 + num_speculative_tokens for a
        schedule on vLLM 0.26, which drafts N and keeps the first k, a k = 0 step included (drafter/vllm_rules.py
        rule "zero_k_range")."""
        from dflashkit.drafter.vllm_rules import schedule_runner

        return 1 + (self.num_speculative_tokens if self.lookup and schedule_runner(self.version) == "v2" else k)

    def step_k(self, batch: int) -> int:
        """The drafts per request of a step with ``batch`` decoding requests (0 without speculation)."""
        if self.method is None or batch == 0:
            return 0
        return self.lookup[min(batch, len(self.lookup) - 1)] if self.lookup else self.num_speculative_tokens

    def _count(self, k: int, accepted: int) -> None:
        if k == 0:
            return
        accepted = min(accepted, k)
        self._counts["drafts"] += 1
        self._counts["draft_tokens"] += k
        self._counts["accepted"] += accepted
        for position in range(accepted):
            self._counts["per_pos"][position] += 1

    # ------------------------------------------------------------------ metrics
    def get_metrics(self) -> list:
        if not self.log_stats:
            raise AssertionError("get_metrics needs LLM(..., disable_log_stats=False), as vLLM's does")
        if self.method is None:
            return []
        c, labels = self._counts, dict(self._labels)
        return [Counter(SPEC_DRAFTS, labels, c["drafts"]), Counter(SPEC_DRAFT_TOKENS, labels, c["draft_tokens"]),
                Counter(SPEC_ACCEPTED, labels, c["accepted"]),
                Vector(SPEC_ACCEPTED_PER_POS, labels, list(c["per_pos"]))]


class _NoDrafter:
    """What SpeculativeDecoder needs of a drafter when only its autoregressive baseline runs."""

    block_size = 2
    mask_token_id = 0
    target_layer_ids = [0]
    input_embedding_scale = 1.0

    def __init__(self):
        from dflashkit.drafter import DrafterConfig

        # its kind (drafter/kinds/): a plain DFlash drafter, one that never drafts
        self.dflash = DrafterConfig(hidden_size=8, num_target_layers=1, vocab_size=2, num_hidden_layers=1,
                                    num_attention_heads=1, target_layer_ids=[0], block_size=2, mask_token_id=0)

    def eval(self):
        return self


def standin_api(version: str = VERSION):
    """The VllmApi of `eval --engine vllm` over this twin following vLLM ``version`` (one modelled clock shared
    by its engines); the version it reports names the twin."""
    from dflashkit.targets.vllm.api import VllmApi

    clock = ModelledClock()
    return VllmApi(lambda **kw: LLM(clock=clock, version=version, **kw), SamplingParams, clock,
                   version=f"{version} (CPU stand-in)")
