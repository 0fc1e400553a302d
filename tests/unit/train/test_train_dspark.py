"""DSpark in the trainer: its term (train/dspark_loss.py ``dspark_term``), computed chunk by chunk inside the
drafter's forward, against the materialised formulas (values and gradients), the step training on it alone, and
the whole road on the CPU: init-drafter, training from shards, `dflashkit export`, what vLLM 0.26 loads, and
`dflashkit eval --mode chain` lossless with the confidence cut reported."""

import json

import pytest
import torch

from dflashkit.train.config import load_config
from dflashkit.train.data import collate_blocks
from dflashkit.train.drafter_pass import forward_blocks
from dflashkit.train.dspark_loss import DSparkLossOptions, dspark_loss_sums, teacher_forced_predecessors
from dflashkit.train.trainer import train

from support.packed_blocks import Head, make_samples, tiny_drafter
from support.training import online_overrides, train_losses
from support.vllm_dspark import vllm_load, vllm_serving_settings

V, H, B = 40, 32, 4


def tiny_dspark():
    torch.manual_seed(0)
    model = tiny_drafter(V, H, B, architecture="dspark", markov_rank=5)
    with torch.no_grad():  # heads off their start, so every term has a gradient to give
        model.markov_head.markov_w2.weight.normal_(0, 0.5)
    return model


def batch():
    return collate_blocks(make_samples([14, 9, 21], V, H, seed=1), block_size=B, mask_token_id=V - 1,
                          num_anchors=6, seed=3, epoch=2, use_last_hidden=True)


def test_the_chunked_term_is_the_materialised_loss_with_its_gradients():
    model, head, packed = tiny_dspark(), Head(V, H, scale=1.5).double(), batch()
    seen = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: seen.update(h=o))
    out = forward_blocks(model, head, packed, block_size=B, layer_types=["full_attention"] * 2, sliding_window=None,
                         variant="ce", chunk_tokens=7)  # 7 rows: 2 blocks a chunk, so several chunks
    hook.remove()
    assert out.loss_sum.grad_fn is None  # DSpark trains on its term alone: the block loss runs without a gradient
    out.extra.loss_sum.backward(retain_graph=True)  # the written-out loss below reuses the forward
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # the same, written out: all blocks' logits at once through the formulas of dspark_loss_sums
    n = packed.labels.shape[0]
    draft = seen["h"][0].view(n, B, -1)[:, 1:]
    prev = teacher_forced_predecessors(packed.block_ids.reshape(n, -1)[:, 0], packed.labels)
    logits = head.lm_head(draft) + model.markov_head(prev)
    target = head.lm_head(packed.last_hidden[packed.teacher_index]).detach()
    sums = dspark_loss_sums(logits, packed.labels, packed.valid, DSparkLossOptions(), target,
                            model.confidence_logits(draft, prev))
    want = sums.combined(DSparkLossOptions())
    torch.testing.assert_close(out.extra.loss_sum, want)
    torch.testing.assert_close(torch.stack([out.extra.ce, out.extra.l1, out.extra.confidence]),
                               torch.stack(list(sums)).detach())
    want.backward()
    assert got.keys() >= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                          "confidence_head.proj.weight", "fc.weight"}
    for name, g in got.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, msg=name)
    hit = (logits.argmax(-1) == packed.labels) & packed.valid
    assert int(out.extra.correct) == int(hit.sum()) and torch.equal(out.extra.runs, hit.double().cumprod(-1).sum(-1))


def test_training_needs_the_targets_last_hidden(tiny_run, tmp_path):
    from dflashkit.errors import UserError

    from support.shards import make_shards
    from support.training import tiny_overrides

    target, _ = tiny_run
    shards = make_shards(tmp_path / "shards", target, num_samples=4, last_hidden=False)
    with pytest.raises(UserError, match="drafter_architecture=dspark .*last_hidden"):
        train(load_config(None, [], **tiny_overrides(shards, tmp_path / "run", drafter_architecture="dspark",
                                                     drafter={"intermediate_size": 64, "markov_rank": 8})))
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


@pytest.mark.slow
def test_init_train_export_serve_check_and_eval_on_the_cpu(chat_run, tmp_path, capsys):
    from dflashkit.eval.engine import DecodeConfig
    from dflashkit.eval.run import run_eval
    from dflashkit.train.export import main as export_main
    from dflashkit.train.init_drafter import main as init_main

    target, data, shards = chat_run
    drafter_fields = {"intermediate_size": 64, "markov_rank": 8}
    fields = dict(drafter_architecture="dspark", drafter=drafter_fields, num_hidden_layers=2, block_size=4,
                  mask_token_id=16, target_layer_ids=[1, 3])
    init_dir = tmp_path / "init"
    assert init_main(["--target", target, "--out", str(init_dir), "--dtype", "float32",
                      *[f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in fields.items()]]) == 0
    assert json.loads((init_dir / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    run = tmp_path / "run"
    summary = train(load_config(None, [], **online_overrides(run, shards=str(shards), max_steps=4,
                                                             init_from=str(init_dir), **{
        k: v for k, v in fields.items() if k not in ("num_hidden_layers", "block_size", "mask_token_id",
                                                      "target_layer_ids")})))
    assert summary["step"] == 4
    term = train_losses(run, "train/dspark_loss")
    assert sorted(term) == [1, 2, 3, 4] and all(v == v and v > 0 for v in term.values())
    assert all(v == v for v in train_losses(run, "train/dspark_l1").values())
    held = train_losses(run, "eval/dspark_ce")
    assert held and all(v == v for v in held.values())
    export = tmp_path / "export"
    assert export_main([str(run), str(export), "--dtype", "float32"]) == 0
    assert '"method": "dspark"' in capsys.readouterr().out  # the serve line vLLM 0.26 takes
    config = json.loads((export / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        vllm_load({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, config)
    assert vllm_serving_settings(config, 3)["method"] == "dspark"
    report = run_eval(target, str(export), tmp_path / "eval", [data],
                      DecodeConfig(max_new_tokens=8, confidence_threshold=0.5), num_prompts=2, device="cpu",
                      dtype="float32")
    lossless = report["overall"]["lossless"]
    assert lossless["prompts"] == 2 and lossless["exact_match_rate"] == 1.0 and not lossless["divergences"]
    cut = report["confidence_cut"]
    assert cut["threshold"] == 0.5 and cut["with"]["prompts"] == cut["without"]["prompts"] == 2
    assert cut["with"]["verified_per_round"] <= cut["without"]["verified_per_round"]
