"""Where the fast Triton kernels can run: the one test that regeneration's decode attention
(extract/generation/decode_attention.py), eval's tree attention (eval/tree_attention.py) and the loss pass's
grouped top-k (train/grouped_topk.py) all ask before choosing the kernel over its plain-PyTorch twin."""

from __future__ import annotations

import os

import torch


def triton_available(device: torch.device | str) -> bool:
    """True when a Triton kernel can run on ``device``: Triton is installed and the device is CUDA, or any device
    under TRITON_INTERPRET=1 (the interpreter the CPU tests run the kernels with)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
