"""DSpark on the CPU from end to end, as a user runs it: `dflashkit init-drafter` with drafter_architecture=dspark,
training from that drafter on shards extracted with the target's last hidden states, `dflashkit export` of the
run (the serve line naming vLLM's "dspark" method), the export against what vLLM 0.26 loads
(tests/support/vllm_dspark.py), and `dflashkit eval --mode chain` lossless against transformers' generate, with
the confidence cut's report field."""

import json

import pytest

from dflashkit.eval.options import EvalOptions
from dflashkit.eval.run import run_eval
from dflashkit.train.export import main as export_main
from dflashkit.train.init_drafter import main as init_main
from dflashkit.train.recipe import load_config
from dflashkit.train.trainer import train

from support.training import extract_chat_run, online_overrides, train_losses
from support.vllm_dspark import vllm_load, vllm_serving_settings


@pytest.mark.slow
def test_init_train_export_serve_check_and_eval_on_the_cpu(tmp_path, capsys):
    target, data, shards = extract_chat_run(tmp_path / "chat")
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
    report = run_eval(EvalOptions(target=target, drafter=str(export), out=tmp_path / "eval", dataset=[data],
                                  max_new_tokens=8, confidence_threshold=0.5, num_prompts=2, device="cpu",
                                  dtype="float32"))
    lossless = report["overall"]["lossless"]
    assert lossless["prompts"] == 2 and lossless["exact_match_rate"] == 1.0 and not lossless["divergences"]
    cut = report["confidence_cut"]
    assert cut["threshold"] == 0.5 and cut["with"]["prompts"] == cut["without"]["prompts"] == 2
    assert cut["with"]["verified_per_round"] <= cut["without"]["verified_per_round"]
