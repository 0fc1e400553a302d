"""train/pass_options.drafter_pass_options: the drafter pass's fixed arguments of a run, which the trainer and
bench/bench_train_throughput.py both hand to train_step."""


import torch

from dflashkit.drafter import DrafterConfig
from dflashkit.drafter.kinds.dflash2 import SelectorOptions
from dflashkit.train.config import TrainConfig
from dflashkit.train.drafter_pass import PassOptions
from dflashkit.train.loss import LossSettings
from dflashkit.train.pass_options import drafter_pass_options


def drafter_config(**extra) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, num_target_layers=4, vocab_size=40, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_layer_ids=[0, 2],
                         block_size=4, mask_token_id=39, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                         **extra)


def test_the_options_follow_the_config_the_drafter_and_the_device():
    dcfg = drafter_config(layer_types=["sliding_attention", "full_attention"], sliding_window=16, causal=True)
    cfg = TrainConfig(compile=True, loss_chunk_tokens=512, selector_loss_weight=0.0, wandb=False)
    cpu = drafter_pass_options(cfg, dcfg, torch.device("cpu"))
    loss = LossSettings(cfg.loss, cfg.gamma, cfg.dpace_alpha, cfg.kl_weight, chunk_tokens=512, fused=False)
    assert cpu == PassOptions(block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                              backend="dense", causal=True, loss=loss, labels="data", extra_term=False,
                              term_options=None)  # DFlash: no options of its own
    dflash2 = drafter_config(architecture="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=5)
    assert drafter_pass_options(cfg, dflash2, torch.device("cpu")).term_options == SelectorOptions()
    for option, value in (("selector_kernel", True), ("selector_unary_grad", True), ("selector_weights", "loss"),
                          ("selector_missing_label", "inject"), ("selector_hidden_grad", False)):
        options = drafter_pass_options(TrainConfig(**{option: value}, wandb=False), dflash2, torch.device("cpu"))
        assert options.term_options == SelectorOptions(**{option.removeprefix("selector_"): value})
    gpu = drafter_pass_options(cfg, dcfg, torch.device("cuda", 0))  # no GPU needed: only the device's type counts
    assert (gpu.backend, gpu.loss.fused) == ("flex", True)
    eager = drafter_pass_options(TrainConfig(attention="split", wandb=False), dcfg, torch.device("cuda", 0))
    assert (eager.backend, eager.loss.fused, eager.extra_term) == ("split", False, False)  # DFlash: none
    assert drafter_pass_options(TrainConfig(attention="split", wandb=False), dflash2, torch.device("cuda", 0)
                                ).extra_term  # DFlash2's selector term, at its default weight


def test_the_loss_and_labels_are_the_configs():
    """The objective, its parameters and the labels come from the config once per run (the step and the held-out
    pass read them from the options, not from the config again)."""
    cfg = TrainConfig(loss="kl", gamma=4.0, kl_weight=0.25, dpace_alpha=0.75, labels="target_argmax", wandb=False)
    options = drafter_pass_options(cfg, drafter_config(), torch.device("cpu"))
    assert options.loss == LossSettings("kl", 4.0, 0.75, 0.25, cfg.loss_chunk_tokens, fused=False)
    assert options.labels == "target_argmax" and options.loss_grad
    held_out = options.held_out(None)
    assert held_out.loss == LossSettings("ce", 4.0, chunk_tokens=cfg.loss_chunk_tokens)
    assert (held_out.labels, held_out.loss_grad, held_out.extra_term) == ("data", False, options.extra_term)
    assert options.held_out(None, extra_term=True).extra_term
