"""`dflashkit eval` with `--engine vllm` served by the CPU twin of vllm.LLM (eval/vllm_standin.py) following vLLM
VERSION: the CPU scale of the lease scripts that serve with two vLLM releases (lab/testbed_engine026_lease.sh).

    python -m lab.standin_vllm_eval 0.24.0 --engine vllm --target DIR --drafter DIR --out DIR ...

Everything after VERSION is `dflashkit eval`'s command line; only where vLLM comes from changes.
"""

import sys

from dflashkit.cli import main as dflashkit_main
from dflashkit.eval import vllm_engine, vllm_standin


def main(argv: list[str]) -> int:
    version, rest = argv[0], argv[1:]
    vllm_engine.real_vllm_api = lambda: vllm_standin.standin_api(version)  # what run_vllm_eval calls for vLLM
    return dflashkit_main(["eval", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
