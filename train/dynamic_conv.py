"""DFlash2's in-block convolution in training by Triton kernels (train/dynamic_conv_triton.py), inside the
compiled drafter layers.

In a profiled DFlash2 step at the testbed's shape the four convolutions of each layer cost ~29 ms of the 43 ms a
DFlash2 step takes more than a DFlash step (H200): inductor compiles the torch expression
(drafter/modeling_dflash2.grouped_dynamic_causal_conv) into several passes over the block positions each way. The
kernels do the forward in one pass and the three gradients in another. They are custom operators
(``dflashkit::dynamic_conv`` and its backward), so a layer compiled with dynamic shapes calls them without a graph
break; inductor compiles the norms, casts and matmuls around them as before.

Used when the run asks for it (``conv_kernel: true``; off by default: on one H100 the operator is at best 12%
under inductor, and with the selector's kernel it took ~10 ms off a ~254 ms DFlash2 step):
``install`` points every convolution of a DFlash2 drafter at ``dynamic_conv``, which takes the kernels where
they fit and the model's own expression elsewhere (the CPU without the interpreter; float64; a group size that
is not a power of two up to 128; a run of positions that is not whole blocks). Values: the kernels sum in float32
and round once, as inductor's fused kernels do; eager torch rounds after each tap in bf16 (the tests bound both).
"""

from __future__ import annotations

import torch

from dflashkit.drafter.modeling_dflash2 import GroupedDynamicCausalConv, grouped_dynamic_causal_conv
from dflashkit.targets.runtime.kernels import triton_available

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MAX_TAPS = 16  # the kernels unroll their taps
MAX_GROUP = 128  # a group is summed inside one tile of channels


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its last dim is contiguous (the kernels' one layout rule), else a contiguous copy: the
    layouts a compiled graph hands an operator are its own choice."""
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("dflashkit::dynamic_conv", mutates_args=())
def _conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int) -> torch.Tensor:
    from .dynamic_conv_triton import launch_forward

    x, dyn, base = _unit_last(x), _unit_last(dyn), _unit_last(base)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch_forward(x, dyn, base, out, group_size, block_size)
    return out


@_conv.register_fake
def _(x, dyn, base, group_size, block_size):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dflashkit::dynamic_conv_backward", mutates_args=())
def _conv_backward(grad: torch.Tensor, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group_size: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .dynamic_conv_triton import launch_backward, row_tiles

    n_rows = x.shape[0]
    grad, x, dyn, base = grad.contiguous(), _unit_last(x), _unit_last(dyn), _unit_last(base)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_dyn = torch.empty(dyn.shape, dtype=dyn.dtype, device=dyn.device)
    per_tile = torch.empty((row_tiles(n_rows, block_size, group_size), *base.shape), dtype=torch.float32,
                           device=x.device)
    launch_backward(grad, x, dyn, base, grad_x, grad_dyn, per_tile, group_size, block_size)
    return grad_x, grad_dyn, per_tile.sum(0).to(base.dtype)


@_conv_backward.register_fake
def _(grad, x, dyn, base, group_size, block_size):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty(dyn.shape, dtype=dyn.dtype, device=dyn.device), torch.empty_like(base))


def _setup_context(ctx, inputs, output):
    x, dyn, base, group_size, block_size = inputs
    ctx.save_for_backward(x, dyn, base)
    ctx.group_size, ctx.block_size = group_size, block_size


def _backward(ctx, grad):
    x, dyn, base = ctx.saved_tensors
    grad_x, grad_dyn, grad_base = _conv_backward(grad, x, dyn, base, ctx.group_size, ctx.block_size)
    return grad_x, grad_dyn, grad_base, None, None


_conv.register_autograd(_backward, setup_context=_setup_context)


def kernel_fits(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                block_size: int) -> bool:
    """Whether ``dynamic_conv`` takes the kernels for these arguments (module docstring); Triton's presence on
    the device is ``install``'s question, asked once."""
    taps, width = base.shape
    return (hidden.dtype in FLOATS and dynamic.dtype in FLOATS and base.dtype in FLOATS
            and hidden.dim() == 3 and hidden.shape[-1] == width and width % group_size == 0
            and 1 <= taps <= MAX_TAPS and 0 < group_size <= MAX_GROUP and group_size & (group_size - 1) == 0
            and dynamic.shape == (*hidden.shape[:-1], taps, width // group_size)
            and hidden.shape[1] % block_size == 0
            and hidden.numel() > 0)


def dynamic_conv(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                 block_size: int) -> torch.Tensor:
    """``grouped_dynamic_causal_conv``'s value and gradients (to hidden, dynamic and base) by the kernels where
    they fit, else by that expression."""
    if not kernel_fits(hidden, dynamic, base, group_size, block_size):
        return grouped_dynamic_causal_conv(hidden, dynamic, base, group_size, block_size)
    width = hidden.shape[-1]
    out = _conv(hidden.reshape(-1, width), dynamic.reshape(-1, *dynamic.shape[-2:]), base, group_size, block_size)
    return out.view(hidden.shape)


def in_block_convolutions(model) -> list[GroupedDynamicCausalConv]:
    """The in-block convolutions of ``model`` (DFlash2's; none for a drafter kind without them)."""
    return [m for m in model.modules() if isinstance(m, GroupedDynamicCausalConv)]


def install(model, device: torch.device | str) -> int:
    """Point every in-block convolution of ``model`` (a DFlash2 drafter, unwrapped) at ``dynamic_conv`` where
    Triton runs on ``device``; returns how many it pointed (0 for a DFlash drafter, or where Triton does not
    run: the convolutions keep the model's expression)."""
    if not triton_available(device):
        return 0
    convs = in_block_convolutions(model)
    for conv in convs:
        conv.conv_fn = dynamic_conv
    return len(convs)
