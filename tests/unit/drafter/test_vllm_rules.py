"""vLLM 0.24's serving rules (drafter/vllm_rules.py VLLM_024_RULES), one test per rule: the last-layer tap and
sliding-window drafter layers (refused by `export --for vllm`, warned otherwise and by `eval --engine vllm`),
num_speculative_tokens = block_size - 1, and a GGUF quantization_config stripped in a copy of the target."""

import json

import pytest
import transformers as tf

from dflashkit.drafter import DrafterConfig
from dflashkit.drafter import vllm_rules as rules

from support.paths import ROOT
from support.tiny_targets import tiny_target_config


def _config(**kw):
    kw.setdefault("target_layer_ids", [0, 1])
    return DrafterConfig.for_target(tiny_target_config(), num_hidden_layers=2, block_size=4, mask_token_id=5, **kw)


def test_every_rule_of_every_release_cites_the_vllm_file():
    names = {"last_layer_tap", "sliding_window", "mixed_layers", "schedule_runner", "zero_k_range", "dspark",
             "target_window", "block_size", "gguf_quantization_config", "cudagraph_ceiling"}
    assert set(rules.VLLM_RULES) == {"0.24", "0.26"}
    for table in rules.VLLM_RULES.values():
        assert set(table) == names and all(".py:" in where for _, where in table.values())


@pytest.mark.parametrize("version,release", [("0.24.0", "0.24"), ("0.25.1", "0.24"), ("0.26.0", "0.26"),
                                             ("0.26.0 (CPU stand-in)", "0.26"), ("0.27.0rc1", "0.26")])
def test_a_version_follows_its_release_rules(version, release):
    assert rules.vllm_release(version) == release
    assert rules.schedule_runner(version) == {"0.24": "v1", "0.26": "v2"}[release]


def test_without_an_installed_vllm_the_rules_are_those_the_project_serves_with(monkeypatch):
    monkeypatch.setattr(rules, "installed_vllm_version", lambda: None)
    assert rules.vllm_release(None) == rules.vllm_release("stand-in") == rules.VLLM_VERSION == "0.26"
    monkeypatch.setattr(rules, "installed_vllm_version", lambda: "0.24.0")
    assert rules.vllm_release(None) == "0.24" and rules.vllm_release("0.26.0") == "0.26"


def test_a_tap_of_the_last_layer_is_refused_for_vllm_and_warned_otherwise():
    cfg = _config(target_layer_ids=[1, 3])  # the tiny target has 4 layers: 3 is L - 1
    with pytest.raises(ValueError, match=r"export for vLLM refused: target_layer_ids \[1, 3\] include 3") as info:
        rules.check_export_for(cfg, "vllm")
    assert "\n" not in str(info.value) and "train with ids below 3" in str(info.value)
    warned = []
    rules.check_export_for(cfg, "all", warn=warned.append)
    assert len(warned) == 1 and "before the final norm" in warned[0]
    rules.check_export_for(_config(), "vllm", warn=warned.append)  # taps below L - 1
    assert len(warned) == 1


def test_sliding_window_layers_are_refused_for_vllm_024_and_warned_otherwise():
    cfg = _config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with pytest.raises(ValueError, match=r"drafter layers \[0\] are sliding_attention: vLLM 0.24.*full attention"):
        rules.check_export_for(cfg, "vllm", version="0.24.0")
    warned = []
    rules.check_export_for(cfg, "all", warn=warned.append, version="0.24.0")
    assert len(warned) == 1 and "ignores layer_types" in warned[0]


def test_sliding_window_layers_are_served_as_trained_by_vllm_026(monkeypatch):
    cfg = _config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    warned = []
    rules.check_export_for(cfg, "vllm", warn=warned.append, version="0.26.0")
    rules.check_export_for(cfg, "all", warn=warned.append, version="0.26.0")
    assert warned == [] and rules.vllm_warnings(cfg, "0.26.0") == []
    monkeypatch.setattr(rules, "installed_vllm_version", lambda: "0.24.0")  # export acts on the installed vLLM
    with pytest.raises(ValueError, match="vLLM 0.24 ignores layer_types"):
        rules.check_export_for(cfg, "vllm")


def test_export_cli_refuses_for_vllm_in_one_line(tmp_path, capsys, monkeypatch):
    from dflashkit.cli import run_main
    from dflashkit.drafter import build_drafter
    from dflashkit.train import export

    model = build_drafter(_config(target_layer_ids=[0, 3]))
    monkeypatch.setattr(export, "load_checkpoint_drafter", lambda pinned, dtype: model)
    monkeypatch.setattr(export, "pin_checkpoint", lambda path: export.PinnedCheckpoint(tmp_path / "ckpt", step=1))
    monkeypatch.setattr(export.PinnedCheckpoint, "trainer_state", lambda self: {})  # no trainer.json: no chat
    assert run_main("dflashkit export", export.main, [str(tmp_path / "ckpt"), str(tmp_path / "out"), "--for",
                                                      "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "include 3" in err[0] and not (tmp_path / "out").exists()
    assert run_main("dflashkit export", export.main, [str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "warning:" in captured.err and '"num_speculative_tokens": 3' in captured.out


def test_num_speculative_tokens_is_block_minus_one():
    assert rules.vllm_num_speculative_tokens(16) == 15
    warned = []
    assert rules.vllm_num_speculative_tokens(16, 7, warn=warned.append) == 7 and "acceptance changes" in warned[0]
    assert '"num_speculative_tokens": 15' in rules.vllm_serve_command("T", "D", 16)
    assert '"num_speculative_tokens": 15' in (ROOT / "README.md").read_text()  # the README's serve command (block 16)


def test_fewer_speculative_tokens_warn_only_for_a_non_causal_drafter():
    warned = []
    assert rules.vllm_num_speculative_tokens(16, 3, warn=warned.append, causal=True) == 3 and warned == []
    assert rules.vllm_num_speculative_tokens(16, 3, warn=warned.append) == 3 and "mask tokens" in warned[0]
    assert rules.vllm_num_speculative_tokens(16, 20, warn=warned.append, causal=True) == 20
    assert "never trained to propose past position 15" in warned[1]


def test_a_gguf_quantization_config_is_stripped_in_a_copy(tmp_path):
    target = tmp_path / "target"
    tf.LlamaForCausalLM(tiny_target_config()).save_pretrained(target)
    config = json.loads((target / "config.json").read_text())
    assert rules.vllm_target_dir(target, tmp_path / "scratch") == (target, False)  # nothing to strip
    config["quantization_config"] = {"quant_method": "gguf", "dequantize": True}
    (target / "config.json").write_text(json.dumps(config))
    served, stripped = rules.vllm_target_dir(target, tmp_path / "scratch")
    assert stripped and served.parent == tmp_path / "scratch"
    assert "quantization_config" not in json.loads((served / "config.json").read_text())
    assert "quantization_config" in json.loads((target / "config.json").read_text())  # the original is untouched
    weights = served / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (target / "model.safetensors").resolve()
    # the copy is kept (a report's directory): another target of the same name served there gets its own links
    other = tmp_path / "elsewhere" / "target"
    tf.LlamaForCausalLM(tiny_target_config()).save_pretrained(other)
    (other / "config.json").write_text(json.dumps(config))
    again, _ = rules.vllm_target_dir(other, tmp_path / "scratch")
    assert again == served and (again / "model.safetensors").resolve() == (other / "model.safetensors").resolve()


@pytest.mark.parametrize("config, max_len, windowed", [
    ({"model_type": "mistral", "sliding_window": 4096}, 8192, True),  # one window for every layer
    ({"model_type": "mistral", "sliding_window": 4096}, 4096, False),  # the window covers every served context
    ({"model_type": "mistral", "sliding_window": 4096, "layer_types": ["sliding_attention"] * 4}, None, True),
    ({"model_type": "qwen3", "sliding_window": 32768, "use_sliding_window": False}, 65536, False),
    ({"model_type": "gemma3_text", "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]},
     8192, False),  # interleaved: vLLM leaves CacheConfig.sliding_window unset
    ({"model_type": "llama", "sliding_window": None}, 8192, False),
    ({"model_type": "mistral3", "text_config": {"sliding_window": 1024}}, 2048, True),
])
def test_a_target_window_that_reaches_the_drafter_is_named(config, max_len, windowed):
    reason = rules.target_window_reason(config, max_len)
    assert (reason is not None) == windowed
    if windowed:
        window = (config.get("text_config") or config)["sliding_window"]
        assert f"sliding_window {window}" in reason and f"max_model_len <= {window}" in reason


def test_cuda_graphs_cover_every_request_of_a_decode_step():
    """vLLM 0.24 captures graphs up to 512 tokens a step by default; c requests at k query c * (1 + k)."""
    assert rules.vllm_cudagraph_capture_size(32, 15) is None  # 512: inside the default
    assert rules.vllm_cudagraph_capture_size(64, 15) == 1024 and rules.vllm_cudagraph_capture_size(128, 7) == 1024
    assert rules.vllm_cudagraph_capture_size(128, 3) is None and rules.vllm_cudagraph_capture_size(128, 0) is None
    assert rules.vllm_cudagraph_capture_size(130, 4) == 656  # 650 rounded up to vLLM's step of 16
    line = rules.vllm_serve_command("T", "D", 16, max_num_seqs=64, cudagraph_capture_size=1024)
    assert line.startswith("vllm serve T --max-num-seqs 64 --max-cudagraph-capture-size 1024 --speculative-config")
