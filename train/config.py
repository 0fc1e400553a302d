"""The training configuration: one dataclass, every field a recipe key (train/recipe.py reads a recipe and
``key=value`` overrides into it).

Design choices:
- Every field is checked when the config is made (``__post_init__``), before anything loads: choices, ranges,
  and ``drafter:``'s keys and values against DrafterConfig (``check_drafter_fields``); the message names the
  field and the fix.
- Training length is set in epochs. ``max_steps`` exists for smoke runs and benchmarks; when it stops a run
  before the last epoch the trainer says so at start and in the run summary (never silently).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from dflashkit.drafter.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_HIDDEN_LAYERS,
    check_block_size,
    check_num_hidden_layers,
)
from dflashkit.drafter.kinds import KINDS, field_owner
from dflashkit.errors import UserError, shown

MUON_NS_DTYPES = ("float32", "bfloat16", "auto")  # muon_ns_dtype's values (train/muon.py); auto: bf16 on a GPU

LOSSES = ("ce", "dpace", "kl")


@dataclass
class TrainConfig:
    # --- data
    shards: str = ""  # directory of feature shards (manifest.json + *.safetensors) from `dflashkit extract`
    target: str = ""  # the target: online, the model run in the loop (required); with shards, where the
    # embedding / final norm / lm_head are read from (empty -> the manifest's target.path)
    max_length: int = 3072  # tokens per training sequence; longer samples keep their first max_length tokens
    eval_samples: int = 64  # held-out samples (fixed by seed) for eval loss, accuracy and tau_sim
    eval_anchors: int = 32  # fixed anchors per held-out sample
    num_workers: int = 2  # DataLoader workers that read shards and pack blocks
    verify_shards: bool = True  # check every shard's size, sha256, layout and finiteness before training
    # --- online training: the target runs in the loop on chat data (train/online.py); shards stays empty
    data: list = field(default_factory=list)  # chat data as for `dflashkit extract --data` (files, dirs, builtin:X)
    data_limit: int = 0  # 0 -> every record; > 0 -> only the first data_limit records
    chat_template: str = ""  # Jinja file replacing the tokenizer's chat template (as extract --chat-template)
    chat_template_kwargs: dict = field(default_factory=dict)  # template variables, e.g. {enable_thinking: false}
    tokenize_workers: int | str = "auto"  # processes rendering + tokenizing the data at start (0: inline); auto:
    # one per 4 of this process's cores (the cores over the launch's processes on this machine), at most 4
    token_cache: bool = True  # keep the token ids under output_dir/token-cache: a resumed run skips tokenizing
    target_dtype: str = "auto"  # the target's dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32
    target_batch_tokens: int = 16384  # padded tokens per target forward (planned samples are run together)
    target_engine: str = "hf"  # what runs the target: "hf" (Hugging Face, in each training process) or "vllm" (a
    # vLLM engine of the one training process, for a target too large for the training GPU or a hybrid one whose
    # HF forward lacks its kernels; train/online_vllm.py; no loss=kl, labels=target_argmax nor layer L-1)
    target_tensor_parallel_size: int = 1  # vllm: GPUs the engine spreads the target over
    target_gpu_memory_utilization: float = 0.5  # vllm: share of each GPU the engine takes (weights + cache); the
    # rest of the first GPU trains the drafter
    # --- drafter
    init_from: str = ""  # drafter export dir to start from (fine-tuning a published drafter); empty -> new
    num_hidden_layers: int = DEFAULT_NUM_HIDDEN_LAYERS  # drafter decoder layers (new drafters only)
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block: the anchor + block_size-1 predictions
    target_layer_ids: list = field(default_factory=list)  # empty -> the shards' layer ids
    mask_token_id: int | None = None  # None -> the tokenizer's mask token, else a spare embedding row
    layer_types: list = field(default_factory=list)  # per drafter layer; empty -> all full_attention
    sliding_window: int | None = None  # window of sliding_attention layers
    causal: bool = False  # every layer causal inside the block (whole context): one drafter for every k served
    drafter: dict = field(default_factory=dict)  # extra DrafterConfig fields, e.g. {intermediate_size: 4096}
    drafter_architecture: str = "dflash"  # "dflash", or "dflash2": in-block convolutions + candidate selector
    # (drafter/modeling_dflash2.py; its sizes are DrafterConfig fields, e.g. drafter: {selector_top_k: 16}), or
    # "dspark": Markov and confidence heads, trained on the paper's objective, which reads the target's
    # distribution (online, or shards with last_hidden; drafter/kinds/dspark.py; drafter: {markov_rank: 256})
    selector_loss_weight: float = 1.0  # dflash2: weight of the selector term added to the block loss
    # (train/selector_loss.py; 1.0 as NeMo Automodel's DFlash2 recipe)
    selector_kernel: bool = False  # dflash2: the selector's pairwise term by Triton kernels without its
    # [positions, top_k, rank] rows (train/selector_pair.py; CUDA only; off: ~1% of a step on one H100)
    conv_kernel: bool = False  # dflash2: the in-block convolutions by Triton kernels, one pass forward and one
    # backward, inside the compiled layers (train/dynamic_conv.py; CUDA only; off: a few % of a step on one H100)
    selector_unary_grad: bool = False  # dflash2: the selector term's gradient reaches the drafter through its
    # unary logits too, as in the public DFlash2 trainers (train/selector_loss.py; off until compared on a GPU)
    selector_hidden_grad: bool = True  # dflash2: the selector's pairwise term trains the drafter's layers through
    # its hidden projection; false stops it there (without selector_unary_grad the layers then learn from the block
    # loss alone; train/selector_loss.py); behind on the testbed
    selector_weights: str = "decay"  # dflash2: the selector term's position weights and normaliser: "decay" (the
    # ce decay) or "loss" (the block loss's own, D-PACE's with the recipe, as SpecForge; train/selector_loss.py)
    selector_missing_label: str = "skip"  # dflash2, training: a valid label not among the candidates adds no
    # selector term ("skip"), or takes the lowest candidate's slot with its own logit ("inject", speculators')
    selector_codebook_lr_scale: float = 1.0  # dflash2: the selector's two codebooks learn at this multiple of the
    # lr (their own optimizer group; a codebook row moves only on the steps its token is drawn; train/muon.py)
    # --- objective
    loss: str = "dpace"  # "ce" | "dpace" | "kl" (train/objectives.py documents each; dpace beat ce at equal data)
    gamma: float = 7.0  # position decay exp(-(k-1)/gamma) of ce and kl
    dpace_alpha: float = 0.5  # D-PACE confidence smoothing (paper Eq. 7)
    kl_weight: float = 0.5  # kl: share of KL(target || draft) in the per-position loss (rest is CE)
    num_anchors: int = 512  # blocks drawn per sequence (fewer when the sequence has fewer candidates)
    anchor_density: float = 0.0  # 0 -> num_anchors per sequence; > 0 -> round(anchor_density * tokens) blocks per
    # sequence instead (at least 1, at most its candidates), so a packed micro-batch of T tokens holds about
    # anchor_density * T blocks (0.375: 3072 per 8192 tokens); per sequence, so packing never changes a sample's draw
    labels: str = "data"  # block labels: "data" (the data's next tokens) or "target_argmax" (the target's greedy
    # choice at each position, argmax lm_head(last_hidden); offline it needs shards with last_hidden)
    loss_chunk_tokens: int = 2048  # logit rows alive at once in the chunked lm_head + loss
    # --- optimisation
    epochs: int = 6  # passes over the training split
    max_steps: int = 0  # 0 -> the epochs decide; > 0 stops after that many optimizer steps (announced)
    lr: float = 6e-4  # peak learning rate
    lr_schedule: str = "cosine"  # after warmup: "cosine" or "linear" decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.0  # floor of the decay as a fraction of lr
    optimizer: str = "adamw"  # "adamw", or "muon": Muon on the drafter's 2-D weight matrices, AdamW on the rest
    # (train/muon.py; single process or DDP; refused under FSDP and DeepSpeed, which shard or flatten the matrices)
    muon_lr: float = 0.0  # peak lr of the Muon matrices; 0 -> lr (Muon's update is scaled to AdamW's RMS)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_ns_dtype: str = "float32"  # Newton-Schulz's matmuls: "float32", "bfloat16" (the Muon authors' form) or
    # "auto": bfloat16 where the matrices are on a GPU, float32 on a CPU (whose bf16 matmuls are far slower)
    warmup_ratio: float = 0.04  # fraction of all steps with linear warmup
    weight_decay: float = 0.0  # AdamW decoupled weight decay (norm weights are never decayed)
    adam_betas: list = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    adam_eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # gradient clipping (0 disables)
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    micro_batch_tokens: int = 4096  # context tokens per micro-batch: whole sequences packed end to end (a longer
    # sequence alone); blocks never see another sequence. 0 -> one sequence per micro-batch. Memory grows with the
    # blocks of all packed sequences (up to num_anchors each, ~0.85 per token for short answers); lower it if a step
    # runs out of GPU memory. More tokens per step run faster per token, but with little data the number of steps
    # binds: on the SmolLM2 testbed 4096 beat 8192 and 16384 at equal data
    mixed_precision: str = "bf16"  # "bf16" (autocast, fp32 master weights) or "no"
    seed: int = 0  # model init, split, data order and anchors
    gradient_checkpointing: bool = False  # recompute drafter layers in backward (long sequences)
    compile: bool = False  # torch.compile each drafter layer (CUDA: ~20% faster steps)
    attention: str = "auto"  # block attention: "auto" (flex on CUDA, dense on CPU), "flex", "dense", or "split"
    # (context keys through flex_attention, each block's own keys as a dense matmul, merged exactly by log-sum-exp:
    # no partial tiles on the block diagonal; train/split_attention.py)
    # --- checkpoints and export
    output_dir: str = "runs/drafter"  # checkpoints/, export/, logs
    save_every: int = 1000  # optimizer steps between checkpoints (0: only at the end)
    keep_last: int = 3  # checkpoints kept (older ones are deleted)
    resume: str = "auto"  # "auto" (latest complete checkpoint in output_dir), "none", or a checkpoint dir
    resume_other_data: bool = False  # resume a checkpoint on data other than the data it was trained on (said at
    # start); without it such a resume is refused, naming what differs (train/data_fingerprint.py)
    export_dir: str = ""  # where the final drafter is exported; empty -> output_dir/export
    overwrite: bool = False  # write into an output_dir that holds files not of a training run (they are kept), and
    # delete an earlier run there; an export_dir that is not a drafter export is never replaced (dflashkit/outputs.py)
    # --- tracking
    log_every: int = 10  # optimizer steps between metric logs
    eval_every: int = 500  # optimizer steps between held-out evaluations (0: only at the end)
    wandb: bool = True  # log to Weights & Biases (offline mode when WANDB_API_KEY is not set)
    wandb_project: str = "dflashkit"  # W&B project
    run_name: str = ""  # W&B / TensorBoard run name; empty -> the output dir's name
    tensorboard: bool = False  # also write TensorBoard event files under output_dir/tb
    progress: bool = True  # console progress bar (loss, tau_sim, tokens/s)

    def __post_init__(self):
        if isinstance(self.data, str):  # data=FILE on the command line
            self.data = [self.data] if self.data else []
        if self.shards and self.data:
            raise UserError(f"shards={shown(self.shards)} and data={shown(self.data)}: train either on shards "
                            "(offline) or on data with the target in the loop (online), not both; drop one")
        if self.target_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise UserError(f"target_dtype: {shown(self.target_dtype)}; use auto, bfloat16, float16 or float32")
        if int(self.target_batch_tokens) < 1:
            raise UserError(f"target_batch_tokens must be >= 1, got {self.target_batch_tokens}")
        check_target_engine(self)
        if self.drafter_architecture not in KINDS:
            raise UserError(f"drafter_architecture: {shown(self.drafter_architecture)}; use one of {sorted(KINDS)}")
        check_drafter_fields(self.drafter, self.drafter_architecture)
        for f in dataclasses.fields(self):
            if str(f.type) == "float" and not math.isfinite(float(getattr(self, f.name))):
                raise UserError(f"{f.name} must be a finite number, got {getattr(self, f.name)}")
        if float(self.selector_loss_weight) < 0:
            raise UserError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}")
        if self.loss not in LOSSES:
            raise UserError(f"loss: {shown(self.loss)} is not one of {LOSSES}")
        if self.mixed_precision not in ("bf16", "no"):
            raise UserError(f"mixed_precision: {shown(self.mixed_precision)}; use 'bf16' or 'no'")
        if self.optimizer not in ("adamw", "muon"):
            raise UserError(f"optimizer: {shown(self.optimizer)}; use 'adamw' or 'muon'")
        if self.lr_schedule not in ("cosine", "linear"):
            raise UserError(f"lr_schedule: {shown(self.lr_schedule)}; use 'cosine' or 'linear'")
        if self.selector_weights not in ("decay", "loss"):
            raise UserError(f"selector_weights: {shown(self.selector_weights)}; use 'decay' or 'loss'")
        if self.selector_missing_label not in ("skip", "inject"):
            raise UserError(f"selector_missing_label: {shown(self.selector_missing_label)}; use 'skip' or 'inject'")
        if not self.selector_codebook_lr_scale > 0:
            raise UserError(f"selector_codebook_lr_scale must be > 0 (a multiple of lr), got "
                            f"{self.selector_codebook_lr_scale}")
        if self.labels not in ("data", "target_argmax"):
            raise UserError(f"labels: {shown(self.labels)}; use 'data' or 'target_argmax'")
        if not 0.0 <= self.anchor_density <= 1.0:
            raise UserError(f"anchor_density must be in [0, 1] (blocks per token; 0 = num_anchors per sequence), "
                            f"got {self.anchor_density}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise UserError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.muon_ns_dtype not in MUON_NS_DTYPES:
            raise UserError(f"muon_ns_dtype: {shown(self.muon_ns_dtype)}; use 'float32', 'bfloat16' or 'auto' "
                            f"(bfloat16 on a GPU, float32 on a CPU)")
        if self.attention not in ("auto", "flex", "dense", "split"):
            raise UserError(f"attention: {shown(self.attention)}; use 'auto', 'flex', 'dense' or 'split'")
        check_block_size(self.block_size)  # bounds of the drafter's fields live in drafter/config.py
        check_num_hidden_layers(self.num_hidden_layers)
        for name in ("epochs", "grad_accum", "num_anchors", "keep_last", "loss_chunk_tokens", "max_length",
                     "eval_anchors", "log_every"):
            if int(getattr(self, name)) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, zero in (("max_steps", "the epochs decide"), ("eval_samples", "no held-out evaluation"),
                           ("num_workers", "read in the training process"), ("data_limit", "every record"),
                           ("save_every", "only at the end"),
                           ("eval_every", "only at the end")):
            if int(getattr(self, name)) < 0:
                raise UserError(f"{name} must be >= 0 (0: {zero}), got {getattr(self, name)}")
        if self.tokenize_workers != "auto" and (isinstance(self.tokenize_workers, (str, bool, float))
                                                or int(self.tokenize_workers) < 0):
            raise UserError(f"tokenize_workers must be auto or a count >= 0 (0: inline), got "
                            f"{shown(self.tokenize_workers)}")
        if not self.lr >= 0:  # 0 keeps the starting weights (a check of init_from)
            raise UserError(f"lr must be >= 0, got {self.lr}")
        if int(self.micro_batch_tokens) < 0:
            raise UserError(f"micro_batch_tokens must be >= 0 (0: one sequence per micro-batch), "
                            f"got {self.micro_batch_tokens}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise UserError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.block_size > self.max_length:  # no block fits a sequence: every step would be padding
            raise UserError(f"block_size={self.block_size} is larger than max_length={self.max_length}: a block "
                            f"must fit in a training sequence; lower block_size or raise max_length to at least "
                            f"{self.block_size}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


TARGET_ENGINES = ("hf", "vllm")  # what runs the target online (train/online.py, train/online_vllm.py)


def check_target_engine(cfg: TrainConfig) -> None:
    """``target_engine`` and its vLLM settings; what vLLM cannot give (the final-norm output) refused by field."""
    if cfg.target_engine not in TARGET_ENGINES:
        raise UserError(f"target_engine: {shown(cfg.target_engine)}; use 'hf' (the target in each training process) or "
                        f"'vllm' (the target in a vLLM engine)")
    if int(cfg.target_tensor_parallel_size) < 1:
        raise UserError(f"target_tensor_parallel_size must be >= 1, got {cfg.target_tensor_parallel_size}")
    if not 0.0 < float(cfg.target_gpu_memory_utilization) <= 1.0:
        raise UserError(f"target_gpu_memory_utilization must be in (0, 1], got {cfg.target_gpu_memory_utilization}")
    if cfg.target_engine != "vllm":
        return
    if cfg.shards:
        raise UserError(f"target_engine=vllm with shards={shown(cfg.shards)}: training on shards runs no target; drop "
                        "target_engine, or train online (--target T --data FILE)")
    for field_name, value, fix in (("loss", "kl", "use loss=dpace (the default) or ce"),
                                   ("labels", "target_argmax", "use labels=data")):
        if getattr(cfg, field_name) == value:
            raise UserError(f"{field_name}={value} with target_engine=vllm: it reads the target's final-norm output, "
                            f"which vLLM does not give (it captures before the final norm); {fix}, or train "
                            f"with target_engine=hf")


# DrafterConfig fields that a recipe's ``drafter:`` mapping does not set, and where they come from instead
DRAFTER_SET_ELSEWHERE = {
    "hidden_size": "the target", "num_target_layers": "the target", "vocab_size": "the target",
    "input_embedding_scale": "the target", "architecture": "drafter_architecture",
    **{name: name for name in ("num_hidden_layers", "block_size", "target_layer_ids", "mask_token_id", "layer_types",
                               "sliding_window", "causal")}}
DRAFTER_POSITIVE_FLOATS = ("rms_norm_eps", "initializer_range")


def check_drafter_fields(drafter, architecture: str) -> None:
    """``drafter:`` (extra DrafterConfig fields) must map DrafterConfig field names, not set elsewhere, to values
    of their types: ints >= 1 (not 4.7, not true), positive finite floats; a kind's own fields (DFlash2's) need
    that kind. Refused before anything loads, instead of a TypeError once the target and the data have."""
    from dflashkit.drafter.config import DrafterConfig

    if not isinstance(drafter, dict):
        raise UserError(f"drafter: {shown(drafter)} is not a mapping; write e.g. drafter: {{intermediate_size: 4096}}")
    kinds = {f.name: str(f.type) for f in dataclasses.fields(DrafterConfig)}
    for key, value in drafter.items():
        if key in DRAFTER_SET_ELSEWHERE:
            source = DRAFTER_SET_ELSEWHERE[key]
            raise UserError(f"drafter: {{{key}: ...}} is set by the target; drop it" if source == "the target" else
                            f"drafter: {{{key}: ...}} is set by the field {source}; move it there ({source}: ...)")
        if key not in kinds:
            raise UserError(f"drafter: unknown field {shown(key)}; the fields are DrafterConfig's in "
                            f"drafter/config.py: {sorted(k for k in kinds if k not in DRAFTER_SET_ELSEWHERE)}")
        owner = field_owner(key)
        if owner is not None and owner.architecture != architecture:
            raise UserError(f"drafter.{key} is a {owner.name} field, unused by drafter_architecture={architecture}; "
                            f"drop it or set drafter_architecture={owner.architecture}")
        check_drafter_value(key, value, kinds[key])


def check_drafter_value(key: str, value, kind: str) -> None:
    """One ``drafter:`` value against its DrafterConfig type, by the rules of check_drafter_fields."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == "int" and not (whole and value >= 1):
        raise UserError(f"drafter.{key}: {shown(value)} is not a whole number >= 1")
    if kind == "float" and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                and math.isfinite(value) and (value > 0 or key not in DRAFTER_POSITIVE_FLOATS)):
        raise UserError(f"drafter.{key}: {shown(value)} is not a finite number > 0")
    if kind == "bool" and not isinstance(value, bool):
        raise UserError(f"drafter.{key}: {shown(value)} is not true or false")
    if kind in ("str", "dict") and not isinstance(value, str if kind == "str" else dict):
        raise UserError(f"drafter.{key}: {shown(value)} is not a {'string' if kind == 'str' else 'mapping'}")
