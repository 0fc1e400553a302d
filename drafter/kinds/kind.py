"""What one drafter kind is (``DrafterKind``): the record each kind file of drafter/kinds/ fills in, and the two
greedy proposal rules the kinds share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dflashkit.errors import UserError


def argmax_proposal(drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                    anchor_ids: torch.Tensor) -> torch.Tensor:
    """Each draft position's most likely token; logits [b, P, V] -> tokens [b, P]."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class DrafterKind:
    architecture: str  # DrafterConfig.architecture (and train's drafter_architecture): the key of KINDS
    name: str  # how messages name it: "DFlash", "DFlash2"
    class_name: str  # config.json's ``architectures`` entry; the class the last modeling file defines
    model_class: type[nn.Module]  # what build_drafter builds for it
    # the modeling files (beside drafter/config.py) an export ships; the last defines model_class
    modeling_files: tuple[str, ...]
    # the greedy proposal of one block: (drafter, hidden [b, P, H], logits [b, P, V], anchor_ids [b]) -> [b, P]
    propose: Callable[..., torch.Tensor] = argmax_proposal
    # a sampled block, for a kind whose draws depend on the token drawn before (DSpark): (drafter, logits [P, V],
    # anchor id, probs_of (logits -> the decoder's filtered distribution), generator) -> (tokens [P], their
    # distributions [P, V]); None: each position drawn from its own logits
    sample_path: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # tree decoding of a kind whose logits depend on the token before (DSpark): (drafter, token) -> the bias [V]
    # added to the logits of that token's children; None: every node's children share their depth's logits
    node_bias: Callable[..., torch.Tensor] | None = None
    # its confidence head's logit per draft position, for cutting verification (eval/confidence_cut.py):
    # (drafter, hidden [P, H], the token before each draft [P]) -> [P]; None: it has none
    confidence: Callable[..., torch.Tensor] | None = None
    # ---- config: the kind's own DrafterConfig fields -> default. Each is a whole number, written to config.json
    # under ``dflash_config`` by its own name (only for this kind), read from there or the top level, and required
    # when a config.json names this kind
    config_fields: dict[str, int] = field(default_factory=dict)
    # (a DrafterConfig) -> config.json fields written at the top level beside the common ones (the names an engine
    # reads there, e.g. DSpark's markov_rank); None: none
    json_fields: Callable[[Any], dict] | None = None
    # (a DrafterConfig) -> None, or UserError naming the field and the fix: the bounds of the kind's own fields
    check_fields: Callable[[Any], None] | None = None
    # ---- loss: the name of the kind's extra training term beside the block loss (train/drafter_pass.py's
    # EXTRA_LOSS_TERMS holds its implementation under that name); None: the block loss alone
    loss_term: str | None = None
    # (a run's settings, e.g. a TrainConfig) -> the term's one options object; None: default options. The object
    # is a frozen dataclass with ``evaluation()``: the options held-out evaluation runs it with
    loss_options: Callable[[Any], Any] | None = None
    # ---- capabilities
    selector: str | None = None  # attribute of its candidate selector module (sampled decoding uses it); None: none
    # None: decoding may verify a tree of its proposals; else why it decodes chains only (the refusal's text)
    chain_only_reason: str | None = None
    # None: it may draft blocks longer than it was trained on; else why it may not (the refusal's text)
    trained_block_reason: str | None = None
    # True: the engines must draft exactly block_size - 1 tokens per step and take no per-batch-size schedule
    whole_block_only: bool = False
    # engine -> the first release that serves this kind (the engines' rules: drafter/serving_rules.py and the files
    # it names: drafter/vllm_rules.py, drafter/vllm_dflash2.py)
    served_by: dict[str, str] = field(default_factory=dict)
    vllm_method: str = "dflash"  # the speculative_config "method" vLLM serves it by

    @property
    def modeling_module(self) -> str:
        """The module of config.json's ``auto_map``: the shipped modeling file that defines ``model_class``."""
        return self.modeling_files[-1].removesuffix(".py")

    @property
    def auto_map(self) -> str:
        """config.json's ``auto_map.AutoModel``: the model class in its shipped modeling file (its name may differ
        from ``class_name``, the name an engine serves it under)."""
        return f"{self.modeling_module}.{self.model_class.__name__}"

    def extra_json_fields(self, config) -> dict:
        """The kind's top-level config.json fields for ``config`` ({} for a kind without)."""
        return {} if self.json_fields is None else self.json_fields(config)

    @property
    def proposes_argmax(self) -> bool:
        """Whether its proposal is each position's argmax (else a walk of the argmax is a second rule beside it)."""
        return self.propose is argmax_proposal

    def selector_of(self, model: nn.Module) -> nn.Module | None:
        """The model's candidate selector module (None for a kind without one)."""
        return None if self.selector is None else getattr(unwrapped(model), self.selector)

    def check_config(self, config) -> None:
        """UserError when a DrafterConfig of this kind sets one of the kind's own fields out of its bounds."""
        if self.check_fields is not None:
            self.check_fields(config)

    def options_from(self, settings) -> Any:
        """The kind's loss options from a run's settings (None for a kind without options)."""
        return None if self.loss_options is None else self.loss_options(settings)

    def default_options(self) -> Any:
        """The kind's loss options at their defaults (None for a kind without options)."""
        return None if self.loss_options is None else self.loss_options(None)

    def check_decoding(self, mode: str, block_size: int, trained_block_size: int) -> None:
        """UserError when the evaluator cannot decode this kind as asked: a tree (``mode``) of a chain-only kind,
        or blocks longer than trained of a kind bound to its trained block."""
        if mode == "tree" and self.chain_only_reason:
            raise UserError(self.chain_only_reason)
        if self.trained_block_reason and block_size > trained_block_size:
            raise UserError(f"block_size {block_size} > the {self.name} drafter's block_size {trained_block_size}: "
                            f"{self.trained_block_reason}; use --block-size <= {trained_block_size}")


def unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP, DeepSpeed and FSDP1 wrappers hold the drafter as .module
