"""Everything of dflashkit that calls vLLM's API, behind one object (``api.VllmApi``, chosen once per run by
``api.load_api``): importing vLLM and giving the GPU back (``runtime``), starting and closing an engine (``api``),
the taps captured during prefill (``capture``: `extract --engine vllm`, `train --target-engine vllm`) and what a
served engine's counters and timestamps say (``metrics``: `eval --engine vllm`, bench/bench_vllm.py).

vLLM is imported only in ``runtime.import_vllm``, only when a run asks for it: the rest of the package runs
without it.
"""
