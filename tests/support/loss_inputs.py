"""Random inputs of the block-loss engine (train/loss.py), for the loss tests."""

import torch


def random_loss_inputs(n: int, p: int, h: int, v: int, seed: int = 0, invalid: float = 0.25):
    """(hidden [n, p, h], lm_head weight [v, h], labels [n, p], valid [n, p], teacher hidden [n, p, h]): n blocks
    of p draft positions, about ``invalid`` of the positions without a label."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, p, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    labels = torch.randint(0, v, (n, p), generator=g)
    valid = torch.rand(n, p, generator=g) > invalid
    teacher = torch.randn(n, p, h, generator=g)
    return hidden, weight, labels, valid, teacher
