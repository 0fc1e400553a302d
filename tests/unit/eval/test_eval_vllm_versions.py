"""`eval --engine vllm` on the rules of the vLLM release that serves (drafter/vllm_rules.py VLLM_RULES), through the
CPU twin of vllm.LLM following 0.24 or 0.26: sliding-window drafter layers (full attention on 0.24, as trained
on 0.26), the runner a schedule is served on, a drafter mixing sliding and full layers on the V1 runner."""

import pytest

from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.eval.chat_settings import resolve_chat
from dflashkit.eval.options import EvalOptions
from dflashkit.eval.vllm_engine import VllmEvalConfig, prepare_run

from support.tiny_targets import VOCAB, tiny_target_config
from support.vllm_pairs import standin_api, write_pair
from support.vllm_standin import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny pair plus ``drafter_swa``: a drafter whose first layer is sliding_attention, its second full."""
    root = write_pair(tmp_path_factory.mktemp("versions"), 4)
    cfg = DrafterConfig.for_target(tiny_target_config(initializer_range=1.0), num_hidden_layers=2, block_size=4,
                                   mask_token_id=VOCAB - 1, layer_types=["sliding_attention", "full_attention"],
                                   sliding_window=3)
    save_drafter(build_drafter(cfg), root / "drafter_swa")
    return root


def _attention(llm):
    return [(a.layer_type, a.sliding_window, a.is_causal) for a in (x.self_attn for x in llm.drafter.layers)]


def test_vllm_026_serves_sliding_layers_as_trained_and_024_as_full_attention(pair):
    spec = {"method": "dflash", "model": str(pair / "drafter_swa"), "num_speculative_tokens": 3}
    trained = [("sliding_attention", 3, True), ("full_attention", None, False)]
    assert _attention(LLM(str(pair / "target"), speculative_config=dict(spec), version="0.26.0")) == trained
    assert _attention(LLM(str(pair / "target"), speculative_config=dict(spec), version="0.24.0")) == [
        ("full_attention", None, False)] * 2


def test_vllm_026_refuses_a_mixed_drafter_on_the_v1_runner(pair, monkeypatch):
    spec = {"method": "dflash", "model": str(pair / "drafter_swa"), "num_speculative_tokens": 3}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match="mixing sliding and full attention layers needs the V2 model runner"):
        LLM(str(pair / "target"), speculative_config=dict(spec), version="0.26.0")
    assert LLM(str(pair / "target"), speculative_config=dict(spec), version="0.24.0").model_runner == "v1"


@pytest.mark.parametrize("version,runner", [("0.24.0", "v1"), ("0.26.0", "v2")])
def test_a_schedule_runs_on_the_runner_of_its_release(pair, version, runner):
    spec = {"method": "dflash", "model": str(pair / "drafter"), "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 4, 0]]}
    assert LLM(str(pair / "target"), speculative_config=spec, max_num_seqs=4, version=version).model_runner == runner
    fixed = {"method": "dflash", "model": str(pair / "drafter"), "num_speculative_tokens": 3}
    assert LLM(str(pair / "target"), speculative_config=fixed, version=version).model_runner == "v2"


@pytest.mark.parametrize("version", ["0.24.0", "0.26.0"])
def test_eval_warns_of_sliding_layers_only_where_vllm_ignores_them(pair, tmp_path, version):
    warned = []
    opts = EvalOptions(target=str(pair / "target"), drafter=str(pair / "drafter_swa"), out=tmp_path,
                       dataset=[str(pair / "chats.jsonl")], num_prompts=2)
    run = prepare_run(opts, VllmEvalConfig(concurrency=[1]), resolve_chat(pair / "drafter_swa", None, None),
                      standin_api(version), warned.append)
    sliding = [w for w in warned if "sliding_attention" in w]
    assert sliding == ([] if version == "0.26.0" else [w for w in run.notes if "vLLM 0.24 ignores layer_types" in w])
    assert len(sliding) == (version == "0.24.0")
