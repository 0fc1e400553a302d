"""The settings of `dflashkit eval`, written once: `EvalOptions`, whose fields are the command's flags
(dflashkit/options.py builds the parser from it), and what the library reads from them.

Every flag keeps its argparse default, so ``None`` still means "not given": a flag that only one engine reads is
refused when given to the other (``ENGINE_ONLY``), and the defaults that depend on the mode (``--concurrency``,
``--repeats``, ...) are filled where the mode runs. The numeric flags are checked against ``FLAG_RANGES`` before
anything loads. Both tables are keyed by field name and sit beside the class; a test holds their keys to its
fields.

The library takes the object, or the part of it it needs: ``run_eval(opts)`` (eval/run.py),
``run_vllm_eval(opts)`` (eval/vllm_engine.py), ``run_sweep(opts)`` (eval/serving.py). ``decode_config`` here and
eval/vllm_engine.py ``vllm_config`` turn it into the decoder's and the vLLM engine's settings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from dflashkit.errors import UserError
from dflashkit.options import option

WHAT, DECODE, HARDWARE, OTHER, VLLM = "what to evaluate", "decoding", "hardware", "other modes", "--engine vllm"


@dataclass
class EvalOptions:
    """The flags of `dflashkit eval`, in the order and help sections of its --help."""

    # ----------------------------------------------------------------------- what to evaluate
    target: str | None = option(help="HF model dir, .gguf file, or testbed:smollm2", group=WHAT)
    drafter: str | None = option(help="drafter export directory (dflashkit export / reference format)", group=WHAT)
    dataset: list[str] = option(
        nargs="+", default_factory=lambda: ["builtin:mtbench"], group=WHAT,
        help="builtin:mtbench, builtin:humaneval, builtin:sharegpt or FILE.jsonl (several allowed)")
    num_prompts: int = option(20, parse=int, help="prompts per dataset", group=WHAT)
    baseline_prompts: int | None = option(
        None, parse=int, group=WHAT,
        help="run the autoregressive baseline (speedup, lossless check) on the first N prompts of each dataset "
             "only (default: all); tau always covers every prompt")
    reference_prompts: int | None = option(
        None, parse=int, group=WHAT,
        help="lossless check against HF generate on the first N baseline prompts of each dataset (default: all of "
             "them; the reference is slow)")
    max_prompt_tokens: int | None = option(None, parse=int, help="keep only the last N prompt tokens", group=WHAT)
    out: str | None = option(help="report directory (report.json, report.md, PNG plots); new or empty", group=WHAT)
    overwrite: bool = option(
        False, group=WHAT,
        help="write into an --out that holds files (an earlier report, files of yours): eval's files of the same "
             "names are replaced, nothing else is touched")
    chat_template: str | None = option(
        None, metavar="FILE", group=WHAT,
        help="Jinja file replacing the target tokenizer's chat template (as extraction and training; default: the "
             "template the drafter was trained with, recorded in its config.json)")
    # JSON text on the command line; a dict given in Python is taken as it is (``template_kwargs``)
    chat_template_kwargs: str | dict | None = option(
        None, group=WHAT,
        help='JSON of extra chat template variables (as extraction and training), e.g. \'{"enable_thinking": '
             "false}' (default: those the drafter was trained with)")
    time_limit: float | None = option(
        None, parse=float, metavar="S", group=WHAT,
        help="stop after the prompt running when S seconds have passed; write a partial report")
    engine: str = option("dflashkit", choices=["dflashkit", "vllm"], group=WHAT,
                         help="dflashkit: its own live decoder (chain / tree); vllm: the pair inside vllm.LLM")
    # ----------------------------------------------------------------------- decoding
    mode: str = option("chain", choices=["chain", "tree"], help=None, group=DECODE)
    tree_budget: int = option(64, parse=int, help="tree mode: nodes per round incl. the root", group=DECODE)
    tree_top_k: int = option(8, parse=int, help="tree mode: candidates per draft position", group=DECODE)
    temperature: float = option(0.0, parse=float, help="0 = greedy; > 0: speculative sampling", group=DECODE)
    top_p: float = option(1.0, parse=float, help="sampling: nucleus mass (1 = off)", group=DECODE)
    top_k: int = option(0, parse=int, help="sampling: keep the k most likely tokens (0 = off)", group=DECODE)
    max_new_tokens: int = option(256, parse=int, help=None, group=DECODE)
    block_size: int | None = option(None, parse=int, help="default: the drafter's block_size", group=DECODE)
    seed: int = option(0, parse=int, help=None, group=DECODE)
    confidence_threshold: float | None = option(
        None, parse=float, metavar="T", group=DECODE,
        help="chain, DSpark drafters: verify each round's drafts up to the first whose confidence is below T, and "
             "report tau and tokens verified per round with and without the cut (0 = off)")
    no_stop: bool = option(False, help="ignore end-of-sequence tokens", group=DECODE)
    # ----------------------------------------------------------------------- hardware
    device: str | None = option(None, help="cpu, cuda, cuda:1 (default: cuda when available)", group=HARDWARE)
    device_map: str | None = option(None, help="spread the target over GPUs (e.g. auto)", group=HARDWARE)
    dtype: str | None = option(None, choices=["float32", "bfloat16", "float16"], group=HARDWARE,
                               help="default: bfloat16 on CUDA, float32 on CPU")
    attention_backend: str = option("auto", choices=["auto", "triton", "torch"], group=HARDWARE,
                                    help="tree attention: Triton kernel on CUDA (auto) or the PyTorch twin")
    no_cuda_graphs: bool = option(
        False, group=HARDWARE,
        help="run the target's decode steps eagerly instead of replaying CUDA graphs (CUDA only)")
    # ----------------------------------------------------------------------- other modes
    compare: list[str] | None = option(None, nargs="+", metavar="REPORT_DIR", group=OTHER,
                                       help="put several reports side by side")
    server: list[str] | None = option(
        None, nargs="+", group=OTHER,
        help="OpenAI-compatible server URL to sweep (vLLM, SGLang); or NAME=URL pairs (none=, kN=, baselines, "
             "schedule=) for the serving plan and its schedule")
    engine_report: str | None = option(
        None, metavar="REPORT_DIR", group=OTHER,
        help="--server NAME=URL: the `eval --engine vllm` report whose serve commands started the servers: what "
             "each serves is checked against the engine of its name, cells side by side")
    model: str | None = option(None, help="--server: model name (default: the server's first)", group=OTHER)
    concurrency: list[int] | None = option(
        None, parse=int, nargs="+", group=OTHER,
        help="requests in flight per level (default --server: 1 2 4 8 16 32; --engine vllm: 1 4 16 64)")
    # ----------------------------------------------------------------------- the flags only --engine vllm reads
    num_speculative_tokens: list[int] | None = option(
        None, parse=int, nargs="+", group=VLLM,
        help="one engine per value; default block_size - 1 (vLLM reads no block_size). Several values give the "
             "per-batch-size schedule (a causal-in-block drafter serves every k as trained; a non-causal one warns: "
             "its acceptance changes)")
    repeats: int | None = option(None, parse=int, group=VLLM,
                                 help="runs per engine and level (default 3): the median is reported with the runs' "
                                      "spread")
    max_requests_per_level: int | None = option(
        None, parse=int, group=VLLM, help="prompts a level takes, cycled to fill its waves (default: every prompt)")
    min_waves: int | None = option(
        None, parse=int, group=VLLM,
        help="a level sends at least this many waves of c requests (default 1; 4 gives runs of seconds where one "
             "wave of many requests takes half a second)")
    cudagraph_capture_size: str | None = option(
        None, metavar="auto|vllm|N", group=VLLM,
        help="vLLM's max_cudagraph_capture_size per engine: auto (default) covers a decode step of the largest "
             "level at the engine's k (vLLM's default stops at 512 tokens and runs larger steps eagerly); vllm: its "
             "default; N: that many tokens")
    baseline: list[str] | None = option(
        None, nargs="+", choices=["ngram", "mtp", "v1"], group=VLLM,
        help="also serve what a user would deploy instead: vLLM's n-gram lookup, the target's MTP head; v1: no "
             "speculation on vLLM's V1 model runner (what a schedule runs on)")
    no_schedule_run: bool = option(False, help="derive the schedule without serving it in one more engine",
                                   group=VLLM)
    prefix_caching: list[str] = option(
        nargs="+", choices=["on", "off"], default_factory=lambda: ["on", "off"], group=VLLM,
        help="vLLM's prefix cache for the multi-turn prompts (the first also serves the main run)")
    gpu_memory_utilization: float = option(0.3, parse=float, help="per vLLM engine", group=VLLM)
    max_model_len: int | None = option(
        None, parse=int, group=VLLM,
        help="default: the longest prompt (multi-turn included) + new tokens + one block")
    enforce_eager: bool = option(False, help="vLLM without CUDA graphs", group=VLLM)
    # None, not False, when not given: --engine dflashkit refuses it only when given (``ENGINE_ONLY``)
    per_prompt: bool | None = option(
        None, action="store_true", group=VLLM,
        help="also send every prompt alone to the drafter's engine (the headline k): each one's τ from vLLM's "
             "counters and its answer, in outputs.jsonl; `--compare` pairs them with a `dflashkit eval` report of "
             "the same prompts")
    # listed under "other modes" in --help, after the vLLM flags as before
    timeout: float = option(300.0, parse=float, help="--server: seconds per request", group=OTHER)

    def template_kwargs(self) -> dict | None:
        """--chat-template-kwargs as a dict (None: not given, the drafter's own are used); UserError naming the
        flag for text that is not a JSON object."""
        text = self.chat_template_kwargs
        if text is None or isinstance(text, dict):
            return text
        try:
            kwargs = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"--chat-template-kwargs {text!r} is not JSON ({error}); "
                            'write e.g. \'{"enable_thinking": false}\'') from None
        if not isinstance(kwargs, dict):
            raise UserError(f"--chat-template-kwargs must be a JSON object, got {text!r}")
        return kwargs


# eval's numeric flags: field -> (lowest allowed, whether the lowest itself is allowed, highest allowed or None,
# what the number is); each is checked before anything loads, in this order
FLAG_RANGES = {
    "num_prompts": (1, True, None, "prompts per dataset"),
    "baseline_prompts": (0, True, None, "0: no autoregressive baseline"),
    "reference_prompts": (0, True, None, "0: no lossless check"),
    "max_prompt_tokens": (1, True, None, "prompt tokens kept"),
    "time_limit": (0, True, None, "seconds; 0 stops after the first prompt, no flag: no limit"),
    "tree_budget": (2, True, None, "nodes per round: the root and at least one draft"),
    "tree_top_k": (1, True, None, "candidates per draft position"),
    "temperature": (0, True, None, "0: greedy"),
    "top_p": (0, False, 1, "1: off"),
    "top_k": (0, True, None, "0: off"),
    "max_new_tokens": (1, True, None, "new tokens per prompt"),
    "block_size": (2, True, None, "the anchor and at least one draft"),
    "concurrency": (1, True, None, "requests in flight"),
    "num_speculative_tokens": (1, True, None, "drafts per step"),
    "repeats": (1, True, None, "runs per engine and level"),
    "max_requests_per_level": (1, True, None, "prompts a level takes"),
    "min_waves": (1, True, None, "waves of c requests per level"),
    "gpu_memory_utilization": (0, False, 1, "share of the GPU"),
    "max_model_len": (1, True, None, "tokens"),
    "timeout": (0, False, None, "seconds per request"),
}
# flags that one engine does not read (field -> who reads it): given to the other, they are refused, not ignored
ENGINE_ONLY = {
    "dflashkit": {"concurrency": "--server and --engine vllm", "num_speculative_tokens": "--engine vllm",
                  "max_model_len": "--engine vllm", "repeats": "--server and --engine vllm",
                  "baseline": "--engine vllm", "max_requests_per_level": "--server and --engine vllm",
                  "min_waves": "--server and --engine vllm", "cudagraph_capture_size": "--engine vllm",
                  "per_prompt": "--engine vllm"},
    "vllm": {"block_size": "the dflashkit engine (with vLLM: --num-speculative-tokens)",
             "time_limit": "the dflashkit engine", "baseline_prompts": "the dflashkit engine",
             "reference_prompts": "the dflashkit engine", "confidence_threshold": "the dflashkit engine"},
}


def _range_text(low, inclusive: bool, high) -> str:
    if high is not None:
        return f"in {'[' if inclusive else '('}{low}, {high}]"
    return f"{'>=' if inclusive else '>'} {low}"


def check_numeric_flags(opts: EvalOptions) -> None:
    """Every numeric flag in its range (``FLAG_RANGES``); one line naming the first flag that is not."""
    for name, (low, inclusive, high, meaning) in FLAG_RANGES.items():
        given = getattr(opts, name)
        for value in given if isinstance(given, list) else [given]:
            if value is None:
                continue
            above = value >= low if inclusive else value > low
            if not (math.isfinite(value) and above and (high is None or value <= high)):
                raise UserError(f"--{name.replace('_', '-')} must be {_range_text(low, inclusive, high)} "
                                f"({meaning}), got {value}")


def check_engine_flags(opts: EvalOptions) -> None:
    """A flag the chosen engine does not read is refused: it would be ignored without a word."""
    for name, reader in ENGINE_ONLY[opts.engine].items():
        if getattr(opts, name) is not None:
            raise UserError(f"--{name.replace('_', '-')} is read by {reader}, not by --engine {opts.engine}: "
                            "drop it, or pick the engine that reads it")


def decode_config(opts: EvalOptions):
    """The dflashkit engine's decoding settings (eval/decoder.py ``DecodeConfig``), unchecked."""
    from .decoder import DecodeConfig

    return DecodeConfig(mode=opts.mode, block_size=opts.block_size, tree_budget=opts.tree_budget,
                        tree_top_k=opts.tree_top_k, temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
                        max_new_tokens=opts.max_new_tokens, seed=opts.seed, attention_backend=opts.attention_backend,
                        cuda_graphs=not opts.no_cuda_graphs, confidence_threshold=opts.confidence_threshold or 0.0)
