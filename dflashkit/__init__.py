"""dflashkit: train DFlash block drafters and measure how many tokens they get accepted."""

import time

__version__ = "0.1.0"

# when this process first imported dflashkit: before a command's own imports (torch, transformers), which a run's
# wall time counts (`dflashkit train` passes it on as the start of metrics.jsonl's elapsed_s)
IMPORTED_AT = time.time()
