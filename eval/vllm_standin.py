"""A CPU twin of `vllm.LLM`: the calls and metric objects `dflashkit eval --engine vllm` uses, decoding for real.

vLLM does not run on a CPU, so the vLLM adapter (eval/vllm_engine.py) and bench/bench_vllm.py run on one with
this twin (tests, `bench_vllm.py --standin`); the GPU run proves the real path.

Design choices:
- ``LLM(model=DIR, speculative_config={"method": "dflash", "model": DRAFTER, "num_speculative_tokens": N})``:
  the target loads with dflashkit's loader (fp32, CPU). ``generate`` decodes every prompt greedily, with a drafter
  through dflashkit's chain decoder with blocks of N + 1 (eval/engine.py, eval/acceptance.py: the acceptance
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
  requests) and loses once they are dominated by the 1 + N tokens each request queries (many requests).
- ``RequestOutput.metrics`` carries the fields of vLLM's RequestStateStats that the adapter reads
  (``first_token_latency``, ``first_token_ts``, ``last_token_ts``, ``num_generation_tokens``).
- Prefix caching (on by default, as in vLLM): the prompt tokens an earlier prompt of the same engine began with
  are not charged in the prefill (``num_cached_tokens``). Acceptance is the decoder's either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestStateStats:  # vllm.v1.metrics.stats.RequestStateStats
    num_generation_tokens: int = 0  # tokens the request produced
    arrival_time: float = 0.0  # when generate() received it
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0  # when its prefill step began
    first_token_ts: float = 0.0  # end of the step that produced its first token
    last_token_ts: float = 0.0  # end of the step that produced its last token
    first_token_latency: float = 0.0  # first_token_ts - arrival_time


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestStateStats | None = None
    num_cached_tokens: int = 0


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


@dataclass
class _Request:
    index: int
    prompt: list[int]
    tokens: list[int]  # the decoded output
    produced: list[int]  # tokens per decode step after the first (the rounds' acceptance lengths; AR: 1s)
    cached: int = 0  # prompt tokens found in the prefix cache
    steps_done: int = 0
    stats: RequestStateStats = field(default_factory=RequestStateStats)


class LLM:
    """``vllm.LLM`` on the CPU (see the module docstring); engine arguments it does not model are recorded."""

    def __init__(self, model: str, *, speculative_config: dict | None = None, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, disable_log_stats: bool = True, clock: ModelledClock | None = None,
                 cost: StepCost | None = None, **engine_kwargs):
        from dflashkit.targets.loading import load_target

        self.model = str(model)
        self.target = load_target(model)
        self.engine_kwargs = engine_kwargs  # dtype, max_model_len, gpu_memory_utilization, ...: not modelled
        self.prefix_caching = bool(enable_prefix_caching)
        self.max_num_seqs = int(max_num_seqs)
        self.log_stats = not disable_log_stats
        self.clock = clock or ModelledClock()
        self.cost = cost or StepCost()
        self.num_speculative_tokens = 0
        self.drafter = None
        if speculative_config is not None:
            from dflashkit.drafter import load_drafter

            if speculative_config.get("method") != "dflash":
                raise ValueError(f"speculative_config method {speculative_config.get('method')!r}: only dflash")
            self.num_speculative_tokens = int(speculative_config["num_speculative_tokens"])
            self.drafter = load_drafter(speculative_config["model"])
        self._seen: list[list[int]] = []  # prompts of this engine (the prefix cache)
        self._decoded: dict[tuple, object] = {}  # (prompt, max_tokens, stop ids) -> its GenerationResult
        self._counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0,
                        "per_pos": [0] * self.num_speculative_tokens}
        self._labels = {"engine": "0", "model_name": self.model}

    # ------------------------------------------------------------------ decoding
    def _decoder(self, max_tokens: int, stop: tuple[int, ...]):
        from .engine import DecodeConfig, SpeculativeDecoder

        config = DecodeConfig(block_size=self.num_speculative_tokens + 1 if self.drafter is not None else None,
                              max_new_tokens=max_tokens, stop_token_ids=stop, cuda_graphs=False,
                              static_draft=self.drafter is not None)
        drafter = self.drafter if self.drafter is not None else _NoDrafter()
        return SpeculativeDecoder(self.target.model, drafter, config)

    def _decode(self, decoder, prompt: list[int], key: tuple) -> tuple[list[int], list[int]]:
        if key not in self._decoded:  # greedy decoding is deterministic: a repeated request decodes once
            self._decoded[key] = (decoder.generate_autoregressive(prompt) if self.drafter is None
                                  else decoder.generate(prompt))
        result = self._decoded[key]
        if self.drafter is None:
            return result.tokens, [1] * (len(result.tokens) - 1)
        n = self.num_speculative_tokens
        self._counts["drafts"] += len(result.accepted_drafts)
        self._counts["draft_tokens"] += n * len(result.accepted_drafts)
        for accepted in result.accepted_drafts:
            self._counts["accepted"] += accepted
            for k in range(min(accepted, n)):
                self._counts["per_pos"][k] += 1
        return result.tokens, list(result.acceptance_lengths)

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

        from .run import stop_ids

        params = sampling_params or SamplingParams()
        if params.temperature:
            raise ValueError("the CPU twin of vllm.LLM decodes greedily only (temperature 0)")
        prompts = [prompts] if isinstance(prompts, dict) else list(prompts)
        ids = [list(p["prompt_token_ids"]) for p in prompts]
        stop = tuple(sorted(set(params.stop_token_ids or ())
                            | (set() if params.ignore_eos else set(stop_ids(self.target)))))
        decoder = self._decoder(params.max_tokens, stop)
        requests = []
        with torch.inference_mode():
            for i, prompt in enumerate(ids):
                tokens, produced = self._decode(decoder, prompt, (tuple(prompt), params.max_tokens, stop))
                requests.append(_Request(i, prompt, tokens, produced))
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
            decoding = [r for r in running if r.steps_done < len(r.produced)]
            queried = 1 + self.num_speculative_tokens
            tokens += queried * len(decoding)
            step = cost.fixed_s + cost.per_token_s * tokens
            if self.drafter is not None and decoding:
                step += cost.draft_fixed_s + cost.draft_per_token_s * queried * len(decoding)
            clock.advance(step)
            for r in joining:
                r.stats.first_token_ts = r.stats.last_token_ts = clock()
                r.stats.first_token_latency = clock() - r.stats.arrival_time
                r.stats.num_generation_tokens = 1
            for r in decoding:
                r.stats.num_generation_tokens += r.produced[r.steps_done]
                r.steps_done += 1
                r.stats.last_token_ts = clock()
            running = [r for r in running + joining if r.steps_done < len(r.produced)]

    # ------------------------------------------------------------------ metrics
    def get_metrics(self) -> list:
        if not self.log_stats:
            raise AssertionError("get_metrics needs LLM(..., disable_log_stats=False), as vLLM's does")
        if self.drafter is None:
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

        # its kind (drafter/kinds.py): a plain DFlash drafter, one that never drafts
        self.dflash = DrafterConfig(hidden_size=8, num_target_layers=1, vocab_size=2, num_hidden_layers=1,
                                    num_attention_heads=1, target_layer_ids=[0], block_size=2, mask_token_id=0)

    def eval(self):
        return self
