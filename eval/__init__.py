"""Acceptance evaluation: live speculative decoding (chain and tree), tree attention, reports, serving sweeps.

`dflashkit eval` (or `python -m dflashkit.eval`) is the command. Modules, one concept each:
acceptance (the greedy acceptance walk over a tree), tree (draft trees and ancestor masks), tree_attention
(the PyTorch twin and the dispatch), tree_attention_triton (the Triton kernel), verifier (the target with its
own KV cache, plugged in through transformers' attention registry), kv_cache (that cache and the compaction of
kept nodes), hybrid (chain verification for targets with recurrent layers), draft_step (the drafter's pass on a
static cache, CUDA graphs), decoder (the round loop and the autoregressive baseline), lossless (the check against
HF generate), run (one evaluation run), options (the command's flags, `EvalOptions`), prompts, report, compare
(reports read back, `--compare`), serving (server_client: the HTTP client of a running server); the
`--engine vllm` run (vllm_engine, vllm_report, served_config) calls vLLM only through targets/vllm/. The
static cache, graph capture, sampling and the target's parts come from the target runtime (targets/runtime/);
stop requests from dflashkit/stopping.py.
"""
