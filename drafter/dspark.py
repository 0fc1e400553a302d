"""DSpark on dflashkit's side: its config fields, building a drafter, and the directory vLLM 0.26 serves as DSpark.

Not yet a drafter kind of drafter/kinds.py (training, eval and ``load_drafter`` do not know it); a DSpark drafter
is a DFlash ``DrafterConfig`` (the backbone) plus ``DSparkFields`` (the heads). The model is
``modeling_dspark.DSparkDraftModel``.

An export directory holds:
- ``model.safetensors``: DFlash's tensors (``layers.{i}.*``, ``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``; drafter/export.py) plus ``markov_head.markov_w1.weight`` [V, r],
  ``markov_head.markov_w2.weight`` [V, r] and, with the confidence head, ``confidence_head.proj.weight``
  [1, H (+ r)] and ``confidence_head.proj.bias`` [1]; nothing of the target (vLLM shares its embedding and
  lm_head when absent, qwen3_dspark.py:149-185, dspark/utils.py:56-72).
- ``config.json``: the DFlash fields (``DrafterConfig.to_json_dict``: ``dflash_config.target_layer_ids`` and
  ``mask_token_id``, ``layer_types``, ``dflash_config.causal``), with ``architectures: ["Qwen3DSparkModel"]`` (vLLM
  picks method "dspark" from it, config/speculative.py:882-887), ``markov_rank`` (qwen3_dspark.py:84-92),
  ``dspark_bonus_anchor: true`` (the 1 + N block dflashkit trains, modeling_dspark.py's docstring),
  ``dspark_block_size`` = block_size - 1, the N drafts of a trained block, unless every layer is causal (vLLM then
  refuses fewer speculative tokens, config/speculative.py:1004-1027: with a non-causal layer a shorter block
  changes every draft; with causal layers the first j drafts are the same for any k >= j), and the reference's
  names of the heads' settings
  (``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``); ``auto_map`` points at the
  shipped ``modeling_dspark.py`` (which imports the shipped ``modeling_dflash.py``).
- ``modeling_dflash.py``, ``modeling_dspark.py``.

SGLang 0.5.17 reads these names (srt/models/dspark.py:405-468: the backbone as DFlash, ``markov_head.*``, and
``confidence_head.*`` required while its head is on) but drafts the reference's N-position block (srt/speculative/
dspark_components/dspark_draft.py:313-323, 369: the anchor and gamma - 1 masks, gamma states, the anchor's
predicting the first draft), so it would shift every prediction of this 1 + N export by one position: not a
serving target for it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dflashkit.errors import UserError
from dflashkit.files import fsync_dir, fsync_tree
from dflashkit.outputs import check_output_dir, make_temp_dir, save_safetensors

from .config import DrafterConfig
from .modeling_dspark import DSparkDraftModel, markov_greedy

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"  # the architectures entry vLLM 0.26 serves as DSpark (registry.py:610)
DSPARK_MODELING_FILES = ("modeling_dflash.py", "modeling_dspark.py")  # shipped; the last defines the model class
DEFAULT_MARKOV_RANK = 256  # the paper's default rank r
MODELING_DIR = Path(__file__).parent


@dataclass(frozen=True)
class DSparkFields:
    markov_rank: int = DEFAULT_MARKOV_RANK  # rank r of the transition bias markov_w2(markov_w1[prev]); >= 1
    confidence_head: bool = True  # train and export the confidence head (vLLM 0.26 loads without it)
    confidence_head_with_markov: bool = True  # the confidence head also reads markov_w1[previous token]

    def __post_init__(self):
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 1:
            raise UserError(f"markov_rank={self.markov_rank!r}; it must be a whole number >= 1 (the paper uses 256)")
        for name in ("confidence_head", "confidence_head_with_markov"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name}={getattr(self, name)!r}; it must be true or false")

    def json_fields(self) -> dict:
        """The heads' settings as config.json names them (the reference's names; vLLM reads markov_rank)."""
        return {"markov_rank": self.markov_rank, "markov_head_type": "vanilla",
                "enable_confidence_head": self.confidence_head,
                "confidence_head_with_markov": self.confidence_head_with_markov}


def _check_backbone(config: DrafterConfig) -> None:
    if config.architecture != "dflash":
        raise UserError(f"architecture={config.architecture!r}: a DSpark drafter's backbone is plain DFlash "
                        f"(architecture=dflash)")


def build_dspark_drafter(config: DrafterConfig, fields: DSparkFields,
                         dtype: torch.dtype = torch.float32) -> DSparkDraftModel:
    """A randomly initialised DSpark drafter: the DFlash backbone of ``config`` plus the heads of ``fields``
    (whose start makes it propose like a DFlash drafter, modeling_dspark.py)."""
    _check_backbone(config)
    hf = config.resolved().to_hf()
    for name, value in fields.json_fields().items():
        setattr(hf, name, value)
    model = DSparkDraftModel(hf).to(dtype)
    model.dflash, model.dspark = config.resolved(), fields
    return model


def markov_proposal(drafter, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
    """The greedy proposal of one block in drafter/kinds.py's signature: logits [b, P, V] (the backbone's, draft
    positions 1..P) -> tokens [b, P], chosen left to right with the Markov bias (``markov_greedy``)."""
    return markov_greedy(logits, anchor_ids, getattr(drafter, "module", drafter).markov_head)  # DDP: .module


def dspark_config_json(config: DrafterConfig, fields: DSparkFields, dtype: torch.dtype) -> dict:
    """config.json of a DSpark export (module docstring): the DFlash fields, the DSpark ones, the weights' dtype."""
    _check_backbone(config)
    cfg = config.to_json_dict()
    cfg["architectures"] = [DSPARK_ARCHITECTURE]
    cfg["auto_map"] = {"AutoModel": f"{DSPARK_MODELING_FILES[-1].removesuffix('.py')}.DSparkDraftModel"}
    cfg.update(fields.json_fields())
    cfg["dspark_bonus_anchor"] = True  # 1 + N queries: anchor, then N masks, each sampled at its own position
    if not config.causal:  # a shorter block than trained would change every draft: vLLM refuses k < N
        cfg["dspark_block_size"] = config.block_size - 1
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).replace("torch.", "")
    return cfg


def dspark_state_dict(model: DSparkDraftModel, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors an export writes, named as vLLM 0.26's DSpark reader takes them (qwen3_dspark.py:149-185): the
    model's own parameter names, without the RoPE tables (recomputed from the config)."""
    return {k: (v.to(dtype) if dtype else v).detach().to("cpu").contiguous()
            for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}


def save_dspark_drafter(model: DSparkDraftModel, out_dir: str | os.PathLike,
                        dtype: torch.dtype | None = None) -> Path:
    """Write the export directory (module docstring) to ``out_dir``, a new or empty directory: written beside
    it and renamed into place, so a crash leaves no half export there. Weights that are not finite are refused
    before anything is written."""
    from .export import check_finite

    config, fields = model.dflash, model.dspark
    state = dspark_state_dict(model, dtype)
    check_finite(state, f"the DSpark drafter to export to {out_dir}", dtype)
    out = Path(out_dir)
    check_output_dir(out, what="a DSpark drafter directory", overwrite=False, flag="(no flag)",
                     problem=lambda p: "it is not empty; DSpark exports are written to a new or empty directory",
                     beside=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, prefix=f".{out.name}.")
    try:
        save_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = dspark_config_json(config, fields, state["fc.weight"].dtype)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for name in DSPARK_MODELING_FILES:
            shutil.copyfile(MODELING_DIR / name, tmp / name)
        fsync_tree(tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out
