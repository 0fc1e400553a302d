"""A drafter's and its optimizer's full state under any backend: gathered to whole tensors for a checkpoint, and
put back into a (possibly sharded) model and optimizer on resume (train/checkpoint.py writes and reads the files).

``torch.distributed.checkpoint.state_dict`` does it for plain, DDP and FSDP models, DeepSpeed's tensor-fragment
API for ZeRO (its flat AdamW state linked to the parameters first), so a checkpoint resumes under any backend and
world size. Every rank must call both directions.
"""

from __future__ import annotations

import os

import torch

from dflashkit.errors import UserError


def _is_deepspeed(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def _unwrapped(model):
    return model.module if hasattr(model, "module") else model


def _link_deepspeed_optimizer_state(engine, create: bool = False) -> None:
    """DeepSpeed links each parameter to its slice of the flat AdamW state lazily, at the first step. For a
    resume before any step, create zero AdamW state and link it now, so the full state can be written in."""
    zero = engine.optimizer
    base = zero.optimizer
    if create:
        flat = [p for g in base.param_groups for p in g["params"]]
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2, ZeRO-3
            flat += list(getattr(zero, attr, None) or [])
        for p in flat:
            if not base.state.get(p):
                base.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if hasattr(zero, "_hp_optimizer_states_linked"):  # it may have been linked while the state was empty
        zero._hp_optimizer_states_linked = False
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2; ZeRO-3 reads the flat state directly
        zero._lazy_init_hp_params_optimizer_state()


def full_state(model, optimizer) -> tuple[dict, dict, dict]:
    """(model fp32 tensors, optimizer tensors, optimizer JSON) as full tensors; every rank must call it."""
    if _is_deepspeed(model):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        _link_deepspeed_optimizer_state(model)
        weights, opt = {}, {}
        for name, p in model.module.named_parameters():
            weights[name] = safe_get_full_fp32_param(p).detach().float().cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(p, key)
                if value is not None:
                    opt[f"state.{name}.{key}"] = value.detach().float().cpu()
        base = model.optimizer.optimizer
        steps = [s["step"] for s in base.state.values() if "step" in s]
        step = float(steps[0]) if steps else 0.0
        for name, _ in model.module.named_parameters():
            if f"state.{name}.exp_avg" in opt:
                opt[f"state.{name}.step"] = torch.tensor(step)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
        return weights, opt, {"param_groups": jsonable(groups)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = {k: v.detach().float().cpu() for k, v in get_model_state_dict(model, options=opts).items()
               if not k.startswith("rotary_emb.")}
    osd = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=opts)
    if "state" not in osd:  # with cpu_offload only rank 0 receives the full state
        return weights, {}, {}
    opt = {}
    for name, state in osd["state"].items():
        for key, value in state.items():
            opt[f"state.{name}.{key}"] = (value if torch.is_tensor(value) else torch.tensor(value)).detach().cpu()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
              for g in osd["param_groups"]]
    return weights, opt, {"param_groups": jsonable(groups)}


def load_full_state(model, optimizer, weights: dict, opt: dict, opt_json: dict,
                    source: str | os.PathLike = "trainer.json") -> None:
    """Put full tensors back into a (possibly sharded) model and optimizer; every rank must call it. ``source``
    (the trainer.json ``opt_json`` was read from) is named when its optimizer groups do not fit."""
    if _is_deepspeed(model):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        _link_deepspeed_optimizer_state(model, create=True)
        import deepspeed

        step = None
        for name, p in model.module.named_parameters():
            safe_set_full_fp32_param(p, weights[name].to(p.device))
            # the working (bf16) copy is refreshed from the fp32 master only at the next step: set it too
            if hasattr(p, "ds_id"):  # ZeRO-3: partitioned
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.data.copy_(weights[name].to(p.dtype))
            else:
                p.data.copy_(weights[name].to(p.dtype))
            for key in ("exp_avg", "exp_avg_sq"):
                if f"state.{name}.{key}" in opt:
                    safe_set_full_optimizer_state(p, opt[f"state.{name}.{key}"].to(p.device), key)
            if f"state.{name}.step" in opt:
                step = opt[f"state.{name}.step"]
        if step is not None:
            for s in model.optimizer.optimizer.state.values():
                if "step" in s:
                    s["step"] = step.to(s["step"].device) if torch.is_tensor(s["step"]) else int(step)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    current = _unwrapped(model).state_dict()
    full = {k: weights[k] if k in weights else v for k, v in current.items()}
    missing = sorted(k for k in current if k not in weights and not k.startswith("rotary_emb."))
    if missing:
        raise UserError(f"checkpoint lacks drafter tensors {missing[:5]}: it was written for another drafter")
    groups = opt_json["param_groups"]
    check_param_groups(groups, getattr(optimizer, "optimizer", optimizer), source)
    set_model_state_dict(model, full, options=opts)
    state: dict = {}
    for key, value in opt.items():
        name, field = key[len("state."):].rsplit(".", 1)
        state.setdefault(name, {})[field] = value
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer),
                             {"state": state, "param_groups": groups}, options=opts)


def check_param_groups(groups: list, optimizer, source) -> None:
    """The saved optimizer groups must pair one to one with ``optimizer``'s, each naming as many parameters."""
    if len(groups) != len(optimizer.param_groups):
        raise UserError(f"{source}: field optimizer.param_groups has {len(groups)} groups, this run's optimizer has "
                        f"{len(optimizer.param_groups)}; resume with the optimizer the checkpoint was written with "
                        f"(optimizer=adamw or muon, and selector_codebook_lr_scale, as in its config), or start a "
                        f"new run")
    for k, (saved, group) in enumerate(zip(groups, optimizer.param_groups)):
        params = saved.get("params")
        if not isinstance(params, list) or len(params) != len(group["params"]):
            raise UserError(f"{source}: field optimizer.param_groups[{k}].params does not list this drafter's "
                            f"{len(group['params'])} parameters; the checkpoint was altered or written for another "
                            f"drafter: use another checkpoint")


def jsonable(x):
    """``x`` as JSON values: tensors as numbers or lists, dict keys as strings, anything else unknown as its
    string (optimizer groups, RNG states, the trainer state)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if torch.is_tensor(x):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)
