"""Export any training checkpoint as a drafter directory (the format vLLM, SGLang and the reference load).

    python -m dflashkit.train.export runs/smollm2/checkpoints/step-00001200 drafters/smollm2
    python -m dflashkit.train.export runs/smollm2 drafters/smollm2          # newest complete checkpoint
    python -m dflashkit.train.export CKPT DIR --dtype float32           # default bfloat16
    python -m dflashkit.train.export CKPT DIR --for vllm                # refuse what vLLM 0.24 serves unlike training

The checkpoint's fp32 master weights and its DrafterConfig (trainer.json) are loaded into a fresh drafter and
written with ``dflashkit.drafter.save_drafter`` in bfloat16 (the published drafters' dtype; a float32 config
would make SGLang and vLLM serve the drafter in float16), with the config's ``dtype`` set to the weights';
an incomplete, corrupted or altered checkpoint (trainer.json checked field by field) and one holding NaN or Inf
weights are refused. The checkpoint is resolved once and its files held open while they are read
(train/pinned_checkpoint.py), so a training still rotating checkpoints cannot change what is exported: the
printed line and the weights' metadata (``dflashkit_step``, ``dflashkit_checkpoint``) name the step read. DIR
never is, lies inside or contains what is read, and is replaced only when it holds a drafter export. The
installed vLLM's rules (drafter/vllm_rules.py VLLM_RULES; 0.26 when none is): a tap of the last target layer,
or sliding-window drafter layers on 0.24, are warned about, or refused with ``--for vllm``; the printed serve
command sets num_speculative_tokens = block_size - 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dflashkit.errors import UserError
from dflashkit.options import build_parser as options_parser
from dflashkit.options import option, parse_options

from .checkpoint import check_trainer_state, checkpoints_root, nonfinite_tensor
from .pinned_checkpoint import PinnedCheckpoint, is_step_dir, pin_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_checkpoint_drafter(pinned: PinnedCheckpoint, dtype: torch.dtype = torch.float32):
    """The drafter stored in a pinned training checkpoint (eval mode, CPU)."""
    from dflashkit.drafter import DrafterConfig, build_drafter

    path = pinned.path
    state = check_trainer_state(pinned.trainer_state(), path, fields=("drafter_config",))
    dcfg = DrafterConfig.from_json_dict(state["drafter_config"], source=f"{path}/trainer.json")
    model = build_drafter(dcfg)
    weights = pinned.weights()
    bad = nonfinite_tensor(weights)
    if bad is not None:  # training stops before writing such a checkpoint; this one was written otherwise
        raise UserError(f"{path}/model.safetensors: tensor {bad} holds NaN or Inf; a diverged drafter is never "
                        f"exported: export an earlier checkpoint")
    expected = {k for k in model.state_dict() if not k.startswith("rotary_emb.")}
    if set(weights) != expected:
        raise UserError(f"{path}/model.safetensors: tensors {sorted(set(weights) ^ expected)[:6]} do not match the "
                        f"drafter_config in trainer.json")
    model.load_state_dict(weights, strict=False)
    return model.to(dtype).eval()


def checkpoint_inputs(path: str | os.PathLike) -> Path:
    """What an export from ``path`` reads: the step directory, or a run directory's checkpoints/ (an export into
    the run directory beside them, e.g. RUN/export, reads nothing of its own)."""
    path = Path(path)
    return path if is_step_dir(path) else checkpoints_root(path)


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                      engine: str = "all", overwrite: bool = False,
                      flag: str = "--overwrite") -> tuple[Path, int, Path]:
    """engine: "all" (warn about what vLLM 0.24 serves differently) or "vllm" (refuse it); drafter/vllm_rules.py.
    ``out_dir`` must lie apart from the checkpoint (dflashkit/outputs.py ``check_apart``); an existing one is
    replaced only when it holds an export (``overwrite``, ``flag``: kept for the callers, forces nothing); both
    checked before the checkpoint is read. The checkpoint is pinned (train/pinned_checkpoint.py): returns (the
    export, the step read, the step directory read), which the export's metadata records too."""
    from dflashkit.drafter import save_drafter
    from dflashkit.drafter.export import export_dir_problem
    from dflashkit.drafter.vllm_rules import check_export_for
    from dflashkit.outputs import check_apart, check_output_dir

    check_apart({"out_dir": out_dir}, {"checkpoint": checkpoint_inputs(path)})
    check_output_dir(out_dir, what="a drafter directory", problem=export_dir_problem, overwrite=overwrite, flag=flag)
    with pin_checkpoint(path) as pinned:
        model = load_checkpoint_drafter(pinned, dtype)
        check_export_for(model.dflash, engine, warn=lambda message: print(message, file=sys.stderr))
        chat = pinned.trainer_state().get("chat") or {}  # what eval renders prompts with
        out = save_drafter(model, out_dir, overwrite=overwrite, flag=flag, chat=chat, metadata=pinned.metadata())
    return out, pinned.step, pinned.path


@dataclass
class ExportOptions:
    """The command line of `dflashkit export` (dflashkit/options.py)."""

    checkpoint: str = option(help="a checkpoint dir (…/checkpoints/step-N) or a run output dir (newest)",
                             flag="checkpoint")
    out_dir: str = option(help="where to write the drafter directory", flag="out_dir")
    dtype: str = option("bfloat16", help="weight dtype of the export (default bfloat16; config.json's dtype "
                                         "follows it)", choices=sorted(DTYPES))
    engine: str = option("all", help="all: an export every engine loads (warns what vLLM 0.24 serves "
                                     "differently); vllm: refuse a drafter vLLM 0.24 would serve unlike its "
                                     "training (drafter/vllm_rules.py)", flag="--for", choices=["all", "vllm"])
    overwrite: bool = option(False, help="accepted for older scripts: a drafter export at out_dir is replaced "
                                         "anyway, anything else never is")


def export(options: ExportOptions) -> tuple[Path, int, Path]:
    """`dflashkit export`: ``export_checkpoint`` with the command's options; returns (the export, the step read,
    the step directory read)."""
    return export_checkpoint(options.checkpoint, options.out_dir, DTYPES[options.dtype], options.engine,
                             overwrite=options.overwrite)


def build_parser() -> argparse.ArgumentParser:
    return options_parser(ExportOptions, prog="dflashkit export", description=__doc__)


def main(argv: list[str] | None = None) -> int:
    out, step, source = export(parse_options(ExportOptions, argv, build_parser()))  # errors: cli.run_main
    print(f"exported step {step} ({source}) -> {out}")
    from dflashkit.drafter import kind_for, read_drafter_config
    from dflashkit.drafter.vllm_rules import vllm_serve_command

    dcfg = read_drafter_config(out)
    spec = {"method": kind_for(dcfg.architecture).vllm_method, "model": str(out),
            "num_speculative_tokens": dcfg.block_size - 1}  # the kind's method: DSpark is vLLM's "dspark"
    print("serve with vLLM: " + vllm_serve_command("TARGET", out, dcfg.block_size, spec))
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit export", main))
