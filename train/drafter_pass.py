"""The drafter's pass over one packed micro-batch (one or more sequences and all their blocks): the block
mask, the drafter's forward and the block loss of its draft positions; used by training and held-out
evaluation alike.

Design choices:
- The block ids are embedded with the target's embedding (times its embedding scale) and every block of the
  micro-batch goes through the drafter in one forward with the packed block mask (train/block_mask.py), which
  keeps each block inside its own sequence. Only draft positions 1..B-1 reach the lm_head; position 0 (the
  anchor) predicts nothing.
- Nothing in a training pass waits for the GPU: masks are built on the device and the loss's metric sums stay
  there (train/metrics.py reduces them for a log line).
- The block loss is one call on the draft positions' states (``BlockLossPass``). A DFlash2 drafter computes its
  selector's teacher-forced scores inside the same forward (so DDP and FSDP see every parameter used there), and
  its candidates are the top_k of the logits the block loss computes anyway: the forward calls the pass (as
  ``selector_targets["candidates"]``), which runs the block loss with ``top_k`` and keeps its output, so the
  lm_head runs once (a second lm_head pass for the candidates cost DFlash2 0.70x DFlash's throughput);
  loss and gradients are those of that two-pass form (tests/unit/train/test_train_selector_candidates.py). With
  the selector's term at weight 0 (``extra_term=False``) no scores are computed and the loss runs after the
  forward, as for DFlash (train/selector_loss.py). A kind names its extra term (drafter/kinds/: ``loss_term``)
  and ``EXTRA_LOSS_TERMS`` holds the term's code under that name; the term's settings are the kind's one options
  object (``term_options``; DFlash2's ``SelectorOptions``, DSpark's ``DSparkLossOptions``), at the kind's
  defaults when none is given. The term's output is ``out.extra``; its weight, normaliser and metrics are the
  term's own (``ExtraLossTerm``). DSpark's forward computes its term itself, chunk by chunk
  (train/dspark_loss.py), and the term replaces the block loss, whose pass then runs after the forward without a
  gradient, for the backbone's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dflashkit.drafter.kinds import KINDS, drafter_kind
from dflashkit.drafter.kinds.dflash2 import SelectorOptions
from dflashkit.errors import UserError

from .block_mask import build_block_masks
from .data import PackedBlocks
from .dspark_loss import dspark_forward_inputs, dspark_metrics
from .loss import BlockLossOutput, LossSettings, block_loss
from .objectives import loss_denominator
from .selector_loss import SelectorLossOutput, candidate_logits, inject_missing_labels, predecessor_ids, selector_loss
from .selector_pair import pair_term


@dataclass(frozen=True)
class ExtraLossTerm:
    """A drafter kind's training term beside the block loss (or in its place), computed from the same forward
    call. Its output (``BlockLossOutput.extra``) has ``loss_sum`` (the weighted sum, differentiable), ``runs`` or
    None (the accepted run of the kind's own greedy rule per block, for held-out walks) and ``metric_sums()``."""

    # (batch, labels [N, B-1], the micro-batch's BlockLossPass) -> the keyword arguments the forward takes for it
    forward_inputs: Callable[..., dict]
    # (what the forward returned for it, the BlockLossPass after the forward, the block loss's variant, gamma)
    # -> the term's output (out.extra)
    loss: Callable[..., Any]
    # (a run's settings, a TrainConfig) -> the term's weight in a step; a weight of 0 skips the term
    weight: Callable[[Any], float]
    # (valid [N, B-1], the run's settings) -> this micro-batch's share of the term's normaliser (summed over the
    # step's micro-batches and ranks, as the block loss's)
    normaliser: Callable[[torch.Tensor, Any], torch.Tensor]
    # (the metric sums the output's metric_sums() added up, prefix) -> the logged metrics; metric_count: how many
    metrics: Callable[[list[float], str], dict]
    metric_count: int
    # (the term's options) -> whether the term reads the target's last hidden states
    needs_last_hidden: Callable[[Any], bool] = lambda options: False
    # True: the step trains on this term alone; the block loss's pass runs without a gradient, for its metrics
    replaces_block_loss: bool = False


class BlockLossPass:
    """The block loss of one micro-batch as a call on its draft positions' states [N, B-1, H]; it keeps the output
    (``out``). DFlash calls it after the forward; DFlash2's forward calls ``candidates`` from inside, which runs
    the same loss with ``top_k`` and hands the selector its candidates (the module notes)."""

    def __init__(self, head, labels: torch.Tensor, valid: torch.Tensor, teacher: torch.Tensor | None,
                 loss: LossSettings, options=None, loss_grad: bool = True, term_grad: bool | None = None):
        self.head, self.labels, self.valid, self.teacher = head, labels, valid, teacher
        self.loss_grad = loss_grad  # False: the loss engine computes no gradient, even in grad mode (evaluation)
        self.term_grad = loss_grad if term_grad is None else term_grad  # the same of the kind's extra term
        self.loss = loss  # block_loss's settings: the objective, its chunking and kernels
        # the kind's term options: DFlash2's SelectorOptions (how its candidates and term are computed), DSpark's
        # DSparkLossOptions
        self.options = options if options is not None else SelectorOptions()
        self.injected: torch.Tensor | None = None  # the labels ``candidates`` put among them
        self.out: BlockLossOutput | None = None

    def __call__(self, hidden: torch.Tensor, top_k: int = 0) -> BlockLossOutput:
        # autocast off: inside a forward that accelerate runs under bf16 autocast, the engine still computes in
        # the dtypes it picks itself, as after the forward
        with torch.autocast(hidden.device.type, enabled=False):
            states = hidden if self.loss_grad else hidden.detach()
            self.out = block_loss(states, self.head.lm_head.weight, self.labels, self.valid, self.loss,
                                  teacher_hidden=self.teacher, lm_head_bias=self.head.lm_head.bias, top_k=top_k)
        return self.out

    def candidates(self, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's candidates, (top_k logits, their ids) [N, B-1, top_k], from the block loss's pass; the
        logits with their gradient to ``hidden`` when the run asks for it (train/selector_loss.py)."""
        out = self(hidden, top_k)
        logits, ids = out.top_logits, out.top_ids
        if self.options.missing_label == "inject" and torch.is_grad_enabled():  # training only
            with torch.autocast(hidden.device.type, enabled=False):
                logits, ids, self.injected = inject_missing_labels(hidden, logits, ids, self.labels, self.valid,
                                                                   self.head.lm_head.weight, self.head.lm_head.bias)
        if self.options.unary_grad and torch.is_grad_enabled():
            return candidate_logits(hidden, logits, ids, self.head.lm_head.weight), ids
        return logits, ids


def selector_forward_inputs(batch: PackedBlocks, labels: torch.Tensor, loss_pass: BlockLossPass) -> dict:
    """DFlash2: what its forward needs to score the candidate selector teacher-forced (the block loss's pass, the
    source of the candidates; the true token before each draft position)."""
    targets = dict(candidates=loss_pass.candidates, predecessor_ids=predecessor_ids(batch.block_ids, labels))
    if loss_pass.options.kernel:  # the pairwise term without its [positions, top_k, rank] rows, where it fits
        targets["pair_term"] = pair_term
    if not loss_pass.options.hidden_grad:  # the pairwise term's gradient stops at the selector's projection
        targets["hidden_grad"] = False
    return {"selector_targets": targets}


def selector_term(scored, loss_pass: BlockLossPass, variant: str, gamma: float) -> SelectorLossOutput:
    """DFlash2: the selector's term from the (scores, candidate_ids) its forward returned, weighted by the decay
    or (``SelectorOptions.weights == "loss"``) by the block loss's own position weights and normaliser, with the
    labels the pass injected among the candidates (selector_loss)."""
    scores, candidates = scored
    weighting = {}
    if loss_pass.options.weights == "loss":
        weighting = dict(weights=loss_pass.out.position_weights,
                         weight_sum=loss_denominator(loss_pass.valid, variant, gamma))
    if loss_pass.injected is not None:
        weighting["injected"] = loss_pass.injected
    return selector_loss(scores, candidates, loss_pass.labels, loss_pass.valid, gamma, **weighting)


def selector_normaliser(valid: torch.Tensor, settings) -> torch.Tensor:
    """DFlash2: the decay-weighted count of valid labels, or with ``selector_weights: loss`` the block loss's own
    denominator (train/selector_loss.py)."""
    variant = settings.loss if settings.selector_weights == "loss" else "ce"
    return loss_denominator(valid, variant, settings.gamma)


def selector_metrics(sums: list[float], prefix: str) -> dict:
    """DFlash2 (train/selector_loss.py): the term, its candidate recall, its teacher-forced accuracy."""
    loss, weight, in_candidates, correct, counted = sums
    if not counted:
        return {}
    return {f"{prefix}/selector_loss": loss / weight, f"{prefix}/selector_recall": in_candidates / counted,
            f"{prefix}/selector_acc": correct / counted}


def dspark_term_output(term_output, loss_pass: BlockLossPass, variant: str, gamma: float):
    """DSpark: its forward computed the term already (train/dspark_loss.py ``dspark_term``)."""
    return term_output


# the kinds' extra terms, under the name a kind gives its own (drafter/kinds/: DrafterKind.loss_term)
EXTRA_LOSS_TERMS = {
    "candidate_selector": ExtraLossTerm(
        selector_forward_inputs, selector_term, weight=lambda settings: float(settings.selector_loss_weight),
        normaliser=selector_normaliser, metrics=selector_metrics, metric_count=5),
    "dspark": ExtraLossTerm(
        dspark_forward_inputs, dspark_term_output, weight=lambda settings: 1.0,
        normaliser=lambda valid, settings: loss_denominator(valid, "ce", settings.gamma),
        metrics=dspark_metrics, metric_count=7, needs_last_hidden=lambda options: options.needs_target,
        replaces_block_loss=True),
}
assert all(kind.loss_term in EXTRA_LOSS_TERMS for kind in KINDS.values() if kind.loss_term), \
    "every drafter kind's loss_term needs its entry in EXTRA_LOSS_TERMS"


def mask_backend(attention: str, device: torch.device) -> str:
    """"dense" (SDPA bool mask; the CPU path), "flex" (BlockMask; on CUDA the drafter runs a compiled
    flex_attention that skips fully masked tiles) or "split" (train/split_attention.py)."""
    if attention != "auto":
        return attention
    return "flex" if device.type == "cuda" else "dense"


def compile_layers(model, dynamic: bool | None = True, backend: str = "inductor") -> None:
    """``torch.compile`` each decoder layer of the drafter (the fastest compiled unit measured),
    for symbolic sizes from the first call (``dynamic=True``).

    Every packed micro-batch has its own context and block counts. Left to decide itself (``dynamic=None``), a
    compiled layer is specialised to the first shape and recompiled with dynamic sizes at the next one, and that
    recompiled graph ran the flex_attention kernels far slower than a layer compiled dynamic from the start, on
    the same inputs (bench/bench_train_throughput.py --layer-probe). ``dynamic=None`` keeps the
    old behaviour (for the
    comparison). Every layer can be compiled many times over a run; the dynamo cache limit is raised for that.

    Sizes that happen to be equal in the first call are not taken for one size (``use_duck_shape`` off, for the
    process): with it on, a first micro-batch whose context and block positions had the same count compiled
    graphs that assumed them equal, and the next micro-batch compiled the layers again (a tiny online run on the
    CPU, ``TORCH_LOGS=recompiles``: the guard ``context.size()[1] == block.size()[1]`` failed at its 2nd step).
    For the same reason inductor's fusion of reductions of mixed order (the norms' backward on the GPU) skips its
    size checks (``mix_order_reduction_non_strict_mode``): each check became a guard on the micro-batch's size
    (``576*block.size()[1] >= 5242880``), and on one H200 a run of 909 steps compiled every layer again when its
    sizes crossed one (steps 30-40: +12 s DFlash, +34 s DFlash2) and again at the epoch's last, small micro-batch
    (+14 s, +36 s)."""
    import torch._dynamo as dynamo
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config

    from dflashkit.drafter.modeling_dflash import flex_attention_for

    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    flex_attention_for(next(model.parameters()).is_cuda)  # built before the layers trace it (its docstring)
    triton = inductor_config.triton
    if hasattr(triton, "mix_order_reduction_non_strict_mode"):
        triton.mix_order_reduction_non_strict_mode = True
    if dynamic and hasattr(fx_config, "use_duck_shape"):
        fx_config.use_duck_shape = False
    for layer in model.layers:
        layer.compile(dynamic=dynamic, backend=backend)


def layers_compiled(model) -> bool:
    """Whether ``compile_layers`` compiled this (unwrapped) drafter's decoder layers."""
    layers = getattr(model, "layers", None)
    return bool(layers) and all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)


def draft_hidden(model, head, batch: PackedBlocks, *, block_size: int, layer_types: list[str],
                 sliding_window: int | None, backend: str = "dense", extra_inputs: dict | None = None,
                 causal: bool = False):
    """The drafter's final hidden states at draft positions 1..B-1 of every block: [N, B-1, H]; with
    ``extra_inputs`` (an extra loss term's forward arguments) also what the forward returned for that term."""
    n = batch.anchors.numel()
    mask = build_block_masks(batch.anchors, batch.ctx_len, block_size, layer_types, sliding_window, backend,
                             context_start=batch.context_start, causal=causal)
    noise = head.embed(batch.block_ids)
    hidden = model(position_ids=batch.position_ids, attention_mask=mask, noise_embedding=noise,
                   target_hidden=batch.target_hidden, **(extra_inputs or {}))
    if extra_inputs:
        hidden, extra = hidden
        return hidden.view(n, block_size, -1)[:, 1:], extra
    return hidden.view(n, block_size, -1)[:, 1:]


@torch.no_grad()
def target_argmax_labels(head, batch: PackedBlocks, chunk_tokens: int = 2048) -> torch.Tensor:
    """The target's greedy choice for every label of ``batch``: label k of the block at a becomes
    argmax lm_head(last_hidden[a+k-1]) where the label is valid (0 elsewhere, as the data labels). The logits are
    taken once per context row (fewer rows than labels), in the lm_head's dtype as the ``kl`` teacher's, then
    compared in fp32."""
    if batch.last_hidden is None:
        raise UserError("labels=target_argmax needs the target's last_hidden in every micro-batch; extract the "
                        "shards with --store-last-hidden, train online, or use labels=data")
    weight, bias = head.lm_head.weight, head.lm_head.bias
    rows = batch.last_hidden
    choice = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
    for s in range(0, rows.shape[0], chunk_tokens):
        logits = torch.nn.functional.linear(rows[s:s + chunk_tokens].to(weight.dtype), weight, bias)
        choice[s:s + chunk_tokens] = logits.float().argmax(-1)
    return torch.where(batch.valid, choice[batch.teacher_index], torch.zeros_like(batch.labels))


@dataclass(frozen=True)
class PassOptions:
    """The drafter pass's arguments that hold for a whole run (train/pass_options.py makes the training's from
    its config; held-out evaluation derives its own with ``held_out``): built once, not per micro-batch."""

    block_size: int  # tokens per block: the anchor and B-1 draft positions
    layer_types: list[str]  # per drafter layer, "full_attention" or "sliding_attention"
    sliding_window: int | None  # the window of the sliding layers
    backend: str = "dense"  # the block mask's form (``mask_backend``)
    causal: bool = False  # a causal-in-block drafter's mask (train/block_mask.py)
    loss: LossSettings = field(default_factory=LossSettings)  # the block loss's objective, chunking and kernels
    labels: str = "data"  # "target_argmax": against the target's greedy tokens (``target_argmax_labels``)
    extra_term: bool = True  # False: the kind's extra term (DFlash2: its selector's) is not computed
    # the kind's options of that term (drafter/kinds/; DFlash2's SelectorOptions: its kernels, gradients, weights
    # and missing labels, all train/selector_loss.py), None for the kind's defaults
    term_options: Any = None
    loss_grad: bool = True  # False: the block loss computes no gradient of the states, even in grad mode

    def held_out(self, term_options, extra_term: bool | None = None) -> PassOptions:
        """These options as held-out evaluation runs its passes (train/evaluate.py): the ``ce`` objective against
        the data's labels with the run's decay, chunking and kernels, the kind's held-out ``term_options``, no
        gradient of the states; ``extra_term`` None keeps the run's."""
        loss = self.loss
        return PassOptions(self.block_size, self.layer_types, self.sliding_window, self.backend, self.causal,
                           LossSettings("ce", loss.gamma, chunk_tokens=loss.chunk_tokens, fused=loss.fused),
                           "data", self.extra_term if extra_term is None else extra_term, term_options,
                           loss_grad=False)


def forward_blocks(model, head, batch: PackedBlocks, options: PassOptions) -> BlockLossOutput:
    """The un-normalised block loss (and metrics) of one packed micro-batch with the run's ``options`` (the
    fields of ``PassOptions`` say what each changes); with ``extra_term`` off ``out.extra`` is None."""
    kind = drafter_kind(model)
    term_options = options.term_options if options.term_options is not None else kind.default_options()
    loss = options.loss
    targets = (target_argmax_labels(head, batch, loss.chunk_tokens) if options.labels == "target_argmax"
               else batch.labels)
    teacher = batch.last_hidden[batch.teacher_index] if loss.variant == "kl" else None  # after the final norm
    term = EXTRA_LOSS_TERMS[kind.loss_term] if options.extra_term and kind.loss_term else None  # DFlash2: selector
    loss_grad = options.loss_grad
    block_grad = loss_grad and not (term is not None and term.replaces_block_loss)  # DSpark: its term alone
    loss_pass = BlockLossPass(head, targets, batch.valid, teacher, loss, term_options, block_grad,
                              term_grad=loss_grad)
    extra_inputs = None if term is None else term.forward_inputs(batch, targets, loss_pass)
    hidden = draft_hidden(model, head, batch, block_size=options.block_size, layer_types=options.layer_types,
                          sliding_window=options.sliding_window, backend=options.backend, extra_inputs=extra_inputs,
                          causal=options.causal)
    if term is None:
        return loss_pass(hidden)
    hidden, extra = hidden
    if loss_pass.out is None:  # a kind whose forward does not run the block loss pass itself (DSpark)
        loss_pass(hidden)
    loss_pass.out.extra = term.loss(extra, loss_pass, loss.variant, loss.gamma)
    return loss_pass.out


def extra_term_of(model) -> ExtraLossTerm | None:
    """The drafter's kind's extra training term (None for a kind with the block loss alone)."""
    name = drafter_kind(model).loss_term
    return None if name is None else EXTRA_LOSS_TERMS[name]
