"""bench/bench_vllm.py's CPU toy: the benchmark over the CPU twin of vllm.LLM (tests/support/vllm_standin.py,
modelled step times), a tiny random pair unless --target and --drafter name one; the CPU scale of the lease
scripts that run the benchmark (lab/testbed_engine_run.sh, testbed_schedule_run.sh, testbed_causal_run.sh,
testbed_quality_run.sh).

    python -m lab.standin_bench_vllm --out /tmp/bench_vllm_toy [bench_vllm's flags]

The twin is a test double, so the benchmark does not ship it; it is reached from the checkout's root as
``tests.support`` (the lab runs from there, as ``python -m lab.X``).
"""

import sys

from bench import bench_vllm
from tests.support import vllm_standin


def main(argv: list[str] | None = None) -> int:
    return bench_vllm.main(argv, toy_api=vllm_standin.standin_api())


if __name__ == "__main__":
    sys.exit(main())
