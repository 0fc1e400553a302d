"""dflashkit: train DFlash block drafters and measure how many tokens they get accepted."""

__version__ = "0.1.0"
