"""Muon for the drafter's weight matrices, AdamW for everything else, in one optimizer.

Muon (K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
kellerjordan.github.io/posts/muon) replaces the update of a 2-D weight by the orthogonalised Nesterov momentum:
the momentum matrix M = U S V^T is mapped to about U V^T by five Newton-Schulz iterations of the quintic
X <- a X + (b A + c A^2) X, A = X X^T, with (a, b, c) = (3.4445, -4.7750, 2.0315), which push every singular
value into roughly [0.7, 1.2] in few steps (they need not converge to 1). The update is then scaled by
0.2 * sqrt(max(m, n)), which gives it the RMS of a typical AdamW update, so AdamW's learning rate and weight decay
carry over (J. Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv:2502.16982, section 2.2).

Design choices:
- One ``torch.optim.Optimizer`` with two kinds of parameter group (``use_muon`` True / False), so accelerate
  prepares it like AdamW and the checkpoint code saves it like AdamW (per-parameter tensors: ``momentum_buffer``
  for Muon, ``exp_avg`` / ``exp_avg_sq`` / ``step`` for AdamW; group fields are plain numbers).
- Which parameters: the weight of every ``nn.Linear`` (the drafter layers' projections and ``fc``; DFlash2's
  kernel and selector projections) (``muon_param_groups``); norm weights, biases, n-D tensors and tables indexed
  by token (embeddings, DFlash2's codebooks: plain 2-D parameters, not linear maps) stay on AdamW, as the Muon
  authors recommend. Muon matrices take the decoupled weight decay; norms never do (as the AdamW path).
- Newton-Schulz runs on the parameter's device (the drafter's matrices are small next to the target), in fp32
  (TrainConfig's default), in bf16 with ``muon_ns_dtype: bfloat16`` (the Muon authors' form), or with ``auto`` in
  bf16 on a GPU and fp32 on a CPU, whose bf16 matmuls are far slower (the testbed recipe's choice). The stacked
  fp32 step on the testbed drafter is bound by its ~260 GFLOP of fp32 matmuls; in bf16 the recipe's whole step
  ran 1.09x faster on one H100, and the held-out curve of
  2,000 steps stayed within 0.02 of the fp32 runs'. The recipe study's ``muon_ns_fp32`` row runs
  the fp32 form against it.
- The step is batched: the momentum, decay and AdamW updates are ``torch._foreach`` ops over a group, and the
  matrices of one shape are orthogonalised as one stack (``stacks``: up to ``STACK_BYTES`` of fp32 at once, so a
  large drafter's matrices still go one at a time). The testbed drafter's 36 matrices come in 5 shapes, so
  Newton-Schulz runs 5 stacks, not 36 matrices, each ~45 kernel launches. On a GPU whose small steps wait on the
  host (the testbed's) those launches were host time. The numbers are the per-matrix ones up to
  float rounding (the tests compare the two, and the AdamW part with ``torch.optim.AdamW``).
- Data parallelism: under DDP every rank holds the all-reduced gradient and the whole matrix, so every rank
  computes the same update. FSDP and DeepSpeed ZeRO hand the optimizer flattened or sharded pieces, on which the
  orthogonalisation of the whole matrix cannot be computed; the trainer refuses that combination, and ``step``
  refuses a Muon parameter that is not a matrix.
"""

from __future__ import annotations

import math

import torch

from dflashkit.errors import UserError

from .config import MUON_NS_DTYPES

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of Jordan et al.: fast growth of small singular values
NS_STEPS = 5  # Newton-Schulz iterations per update
RMS_MATCH = 0.2  # Moonlight: update * 0.2 * sqrt(max(m, n)) has AdamW's update RMS
NS_DTYPES = {name: getattr(torch, name) for name in MUON_NS_DTYPES if name != "auto"}  # muon_ns_dtype's dtypes
STACK_BYTES = 256 << 20  # matrices of one shape orthogonalised together up to this much fp32 (see ``stacks``)


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About U V^T for g = U S V^T (singular values mapped into ~[0.7, 1.2]), computed in ``dtype`` (fp32, or
    bf16 as the Muon authors run it; the normalisation in fp32 either way); ``g`` is one matrix [m, n] or a stack
    of them [s, m, n], each orthogonalised on its own (one batched matmul per product). Returns fp32."""
    if g.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz orthogonalises matrices; got a tensor of shape {tuple(g.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the wide orientation: A = X X^T is the smaller Gram matrix
        x = x.mT
    # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.float()
    return x.mT if tall else x


def stacks(tensors: list[torch.Tensor], max_bytes: int = STACK_BYTES) -> list[list[int]]:
    """The indices of ``tensors`` grouped for one batched Newton-Schulz each: the same shape, device and dtype, in
    order, at most ``max_bytes`` of fp32 per group (a larger matrix alone)."""
    groups: dict[tuple, list[list[int]]] = {}
    for i, t in enumerate(tensors):
        runs = groups.setdefault((tuple(t.shape), t.device, t.dtype), [[]])
        if runs[-1] and (len(runs[-1]) + 1) * t.numel() * 4 > max_bytes:
            runs.append([])
        runs[-1].append(i)
    return [run for runs in groups.values() for run in runs]


def check_backend(backend_name: str) -> None:
    """Refuse the backends that hand the optimizer sharded or flattened matrices (accelerate's names)."""
    if backend_name in ("FSDP", "DEEPSPEED"):
        raise UserError(f"optimizer=muon needs whole weight matrices on every rank, and {backend_name} shards or "
                        f"flattens them; use the DDP accelerate config, or optimizer=adamw")


def never_decayed(name: str, p) -> bool:
    """Norm weights and DFlash2's base convolution kernels (initialised to the identity tap: decay would pull the
    layers' convolutions towards zero) get no weight decay."""
    return p.ndim < 2 or name.endswith("base_kernel")


def is_codebook(name: str) -> bool:
    """DFlash2's selector codebooks (``predecessor_codebook``, ``successor_codebook``): tables indexed by token."""
    return name.endswith("_codebook")


def codebook_group(groups: list[dict], model, lr: float | None, weight_decay: float, scale: float) -> list[dict]:
    """``groups`` with the selector's codebooks moved into an AdamW group of their own at ``scale`` times ``lr``
    (as decayed as before); the groups unchanged at scale 1, so the runs and checkpoints of before keep their
    layout. A codebook row has a gradient only on the steps its token is drawn (public DFlash2 trainers give the
    codebooks ~10x the lr); ``selector_codebook_lr_scale``."""
    if scale == 1.0:
        return groups
    if lr is None:
        raise ValueError("codebook_group: a codebook lr scale needs the peak lr it multiplies")
    books = {id(p) for name, p in model.named_parameters() if p.requires_grad and is_codebook(name)}
    moved = [p for g in groups for p in g["params"] if id(p) in books]
    if not moved:
        return groups
    for g in groups:
        g["params"] = [p for p in g["params"] if id(p) not in books]
    book_lr = lr * scale
    groups.append({"params": moved, "use_muon": False, "lr": book_lr, "base_lr": book_lr,
                   "weight_decay": weight_decay})
    return [g for g in groups if g["params"]]


def muon_param_groups(model, *, lr: float, muon_lr: float, weight_decay: float,
                      codebook_lr_scale: float = 1.0) -> list[dict]:
    """Muon for the weights of the linear maps, AdamW for the rest; ``base_lr`` is each group's peak lr;
    ``codebook_lr_scale``: ``codebook_group``."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    matrices, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in linear and p.ndim == 2:
            matrices.append(p)
        elif p.ndim >= 2 and not never_decayed(name, p):
            decay.append(p)
        else:
            no_decay.append(p)  # norms are never decayed
    muon_lr = muon_lr or lr
    groups = [{"params": matrices, "use_muon": True, "lr": muon_lr, "base_lr": muon_lr, "weight_decay": weight_decay},
              {"params": decay, "use_muon": False, "lr": lr, "base_lr": lr, "weight_decay": weight_decay},
              {"params": no_decay, "use_muon": False, "lr": lr, "base_lr": lr, "weight_decay": 0.0}]
    return codebook_group([g for g in groups if g["params"]], model, lr, weight_decay, codebook_lr_scale)


class Muon(torch.optim.Optimizer):
    """Muon on groups with ``use_muon=True`` (2-D parameters), AdamW on the others (module docstring)."""

    def __init__(self, param_groups, *, lr: float = 6e-4, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = NS_STEPS, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 ns_dtype: str = "float32"):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, use_muon=False)
        super().__init__(param_groups, defaults)
        if ns_dtype not in MUON_NS_DTYPES:
            raise UserError(f"muon_ns_dtype: {ns_dtype!r}; use one of {', '.join(MUON_NS_DTYPES)}")
        # the run's choice, not saved with the state: a resumed run computes as its config says; None: auto
        self.ns_dtype = NS_DTYPES.get(ns_dtype)

    def ns_dtype_on(self, device: torch.device) -> torch.dtype:
        """Newton-Schulz's dtype for matrices on ``device``: the fixed one, or for auto bf16 on a GPU and fp32
        elsewhere (a CPU's bf16 matmuls run 15-37x slower than its fp32 ones at the testbed's shapes)."""
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, mu, wd = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            if p.ndim != 2:
                raise UserError(f"optimizer=muon got a parameter of shape {tuple(p.shape)} in a Muon group: the "
                                f"backend flattened or sharded it (FSDP, DeepSpeed ZeRO); use optimizer=adamw there")
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        grads = [p.grad.float() for p in params]
        torch._foreach_mul_(bufs, mu)  # M_t = mu M_{t-1} + G_t
        torch._foreach_add_(bufs, grads)
        directions = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs  # G_t + mu M_t
        if wd:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        for run in stacks(params, STACK_BYTES):
            update = newton_schulz(torch.stack([directions[i] for i in run]), int(group["ns_steps"]),
                                   dtype=self.ns_dtype_on(params[run[0]].device))
            update.mul_(RMS_MATCH * math.sqrt(max(params[run[0]].shape)))
            torch._foreach_add_([params[i] for i in run], list(update.to(params[run[0]].dtype).unbind(0)),
                                alpha=-lr)

    def _adamw_group(self, group: dict) -> None:
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1  # a CPU scalar: no launch
        steps = [float(self.state[p]["step"]) for p in params]
        exp_avg = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]
        grads = [p.grad for p in params]
        torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - beta2)
        if wd:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        denom = torch._foreach_div(exp_avg_sq, [1.0 - beta2 ** t for t in steps])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, [-lr / (1.0 - beta1 ** t) for t in steps])
