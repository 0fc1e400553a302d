"""The benchmarks a user runs on their own drafter, each a module run from the checkout's root
(``python -m bench.bench_vllm --help``). Nothing of the product imports them."""
