"""`dflashkit eval` with `--engine vllm` served by the CPU twin of vllm.LLM (tests/support/vllm_standin.py) following
vLLM VERSION: the CPU scale of the lease scripts that serve with two vLLM releases (lab/testbed_engine026_lease.sh).

    python -m lab.standin_vllm_eval 0.24.0 --engine vllm --target DIR --drafter DIR --out DIR ...

Everything after VERSION is `dflashkit eval`'s command line; only where vLLM comes from changes (the one place a
run chooses it, targets/vllm/api.py ``installed_api``). The twin is a test double of the tests' support package,
reached from the checkout's root as ``tests.support`` (the lab runs from there, as ``python -m lab.X``).
"""

import sys

from dflashkit.cli import main as dflashkit_main
from dflashkit.targets.vllm import api
from tests.support import vllm_standin


def main(argv: list[str]) -> int:
    version, rest = argv[0], argv[1:]
    api.installed_api = lambda settle=True: vllm_standin.standin_api(version)  # what load_api calls for vLLM
    return dflashkit_main(["eval", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
