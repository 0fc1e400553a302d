"""`dflashkit eval` end to end: a tiny random Llama saved with the testbed's tokenizer, a random drafter export,
the built-in MT-bench and HumanEval prompts; then `--compare` of a chain and a tree report."""

import json

import pytest
import transformers as tf

from dflashkit.cli import run_main
from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter
from dflashkit.eval.__main__ import main as eval_main
from dflashkit.eval.prompts import load_prompts

from support.chat_templates import QWEN3

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 6


def main(argv):
    """The command as `dflashkit eval` runs it: a user error is one line on stderr and exit status 2."""
    return run_main("dflashkit eval", eval_main, argv)


def _run(root, out, *extra):
    return main(["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--dataset",
                 "builtin:mtbench", "builtin:humaneval", "--num-prompts", "2", "--max-new-tokens", str(NEW),
                 "--no-stop", "--out", str(out), *extra])


def test_eval_writes_a_complete_report_and_compares(chat_pair, tmp_path, capsys):
    root, tokenizer = chat_pair
    assert _run(root, tmp_path / "chain") == 0
    said = capsys.readouterr().out.splitlines()[-1]  # its speedup is the harness's, and says so (issue 68)
    assert said.startswith("tau ") and "; harness speedup " in said
    assert "harness speedup: dflashkit's own decode loop, not a serving engine" in said
    assert _run(root, tmp_path / "tree", "--mode", "tree", "--tree-budget", "6", "--tree-top-k", "2") == 0
    report = json.loads((tmp_path / "chain" / "report.json").read_text())
    assert set(report["datasets"]) == {"builtin:mtbench", "builtin:humaneval"}
    overall = report["overall"]
    assert overall["prompts"] == 4 and overall["new_tokens"] == 4 * NEW
    histogram = {int(k): v for k, v in overall["acceptance_histogram"].items()}
    assert sum(histogram.values()) == overall["rounds"]
    assert sum(k * v for k, v in histogram.items()) == 4 * (NEW - 1)  # every token after the prefill's
    assert overall["tau"] == pytest.approx(4 * (NEW - 1) / overall["rounds"])
    assert len(overall["per_position_acceptance"]) == 3 == report["block_size"] - 1
    lossless = overall["lossless"]
    assert lossless["prompts"] == 4 and lossless["mismatches"] == 0 and lossless["divergences"] == []
    assert lossless["exact_match_rate"] == 1.0 and lossless["reference"]["attention"] == "sdpa"
    assert overall["speedup"] > 0 and overall["verify_over_ar_step"] > 0 and overall["draft_over_ar_step"] > 0
    assert overall["cost_model_speedup"] == pytest.approx(  # the baseline covers every prompt here
        overall["tau"] / (overall["verify_over_ar_step"] + overall["draft_over_ar_step"]))
    assert overall["cost_model_inputs"]["tau"] == pytest.approx(overall["tau"])
    # the same outputs (fp32, no stop token): per token is the wall-time ratio, and the ratio divides by the model
    assert overall["paired_tokens"] == {"speculative": 4 * NEW, "autoregressive": 4 * NEW}
    assert overall["speedup_per_token"] == pytest.approx(overall["speedup"])
    assert overall["speedup_over_cost_model"] == pytest.approx(overall["speedup"] / overall["cost_model_speedup"])
    assert {"load", "prepare", "reference", "speculative", "baseline"} <= set(report["timing"])
    md = (tmp_path / "chain" / "report.md").read_text()
    assert "partial" not in report and "Lossless: no mismatch" in md and "| harness speedup |" in md
    assert report["drafter"]["block_size"] == 4 and report["target"]["config_hash"]
    assert report["args"]["mode"] == "chain" and report["versions"]["transformers"] == tf.__version__
    for name in ("report.md", "acceptance_histogram.png", "per_position_acceptance.png", "tau_per_dataset.png"):
        assert (tmp_path / "chain" / name).stat().st_size > 0
    tree = json.loads((tmp_path / "tree" / "report.json").read_text())
    assert 1 < tree["overall"]["mean_nodes_per_round"] <= 6 and tree["overall"]["lossless"]["mismatches"] == 0
    assert tree["overall"]["lossless"]["exact_match_rate"] == 1.0

    # outputs.jsonl: each prompt's run, adding up to the report's numbers
    lines = [json.loads(x) for x in (tmp_path / "chain" / "outputs.jsonl").read_text().splitlines()]
    assert [x["dataset"] for x in lines] == ["builtin:mtbench"] * 2 + ["builtin:humaneval"] * 2
    assert sum(x["rounds"] for x in lines) == overall["rounds"] and all(len(x["tokens"]) == NEW for x in lines)
    assert len({x["id"] for x in lines}) == 4 and sum(x["round_tokens"] for x in lines) == pytest.approx(
        overall["rounds"] * (1 + sum(overall["per_position_acceptance"])))  # before the cap, as vLLM counts
    trees = [json.loads(x) for x in (tmp_path / "tree" / "outputs.jsonl").read_text().splitlines()]
    assert [x["tokens"] for x in trees] == [x["tokens"] for x in lines]  # lossless: the target's answers

    capsys.readouterr()
    assert main(["--compare", str(tmp_path / "chain"), str(tmp_path / "tree"), "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "| chain |" in table and "| tree |" in table and f"{overall['tau']:.3f}" in table
    assert (tmp_path / "cmp" / "tau_compare.png").exists()
    # the same answers, so over them each report's τ is its own overall τ
    paired = table.split("(outputs.jsonl)")[1]
    assert (f"| {tmp_path / 'tree'} | 4 | 4 | — | {overall['tau']:.3f} | {tree['overall']['tau']:.3f} | "
            f"{overall['tau']:.3f} | {tree['overall']['tau']:.3f} |") in paired
    assert paired.strip() in (tmp_path / "cmp" / "compare.md").read_text()


def test_baseline_on_the_first_prompts_only(chat_pair, tmp_path):
    root, _ = chat_pair
    assert _run(root, tmp_path / "all") == 0
    full = json.loads((tmp_path / "all" / "report.json").read_text())
    assert _run(root, tmp_path / "one", "--baseline-prompts", "1") == 0
    part = json.loads((tmp_path / "one" / "report.json").read_text())
    # tau covers every prompt: the same rounds as the run with a baseline for all of them
    assert part["overall"]["rounds"] == full["overall"]["rounds"] and part["overall"]["prompts"] == 4
    assert part["overall"]["baseline_prompts"] == 2  # the first prompt of each of the two datasets
    assert part["datasets"]["builtin:mtbench"]["baseline_prompts"] == 1
    assert part["overall"]["lossless"]["prompts"] == 2 and part["overall"]["lossless"]["divergences"] == []
    assert part["overall"]["speedup"] > 0
    assert part["overall"]["cost_model_inputs"]["prompts"] == 2  # the model covers the prompts the speedup does
    assert _run(root, tmp_path / "none", "--baseline-prompts", "0") == 0
    none = json.loads((tmp_path / "none" / "report.json").read_text())
    assert "speedup" not in none["overall"] and "lossless" not in none["overall"]
    assert none["overall"]["rounds"] == full["overall"]["rounds"]
    assert "AR baseline prompts" in (tmp_path / "one" / "report.md").read_text()


def test_prompts_are_the_first_user_turn_in_the_chat_template(chat_pair):
    _, tokenizer = chat_pair
    prompts = load_prompts("builtin:mtbench", tokenizer, num_prompts=2)
    assert len(prompts) == 2 and [m["role"] for m in prompts[0].messages] == ["user"]
    expected = tokenizer.apply_chat_template(prompts[0].messages, tokenize=False, add_generation_prompt=True)
    assert prompts[0].input_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(prompts[0].input_ids).endswith("<|im_start|>assistant\n")


def test_mismatched_drafter_is_refused(chat_pair, tmp_path, capsys):
    root, _ = chat_pair
    other = tf.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)
    save_drafter(build_drafter(DrafterConfig.for_target(other, num_hidden_layers=1, mask_token_id=0)),
                 tmp_path / "bad")
    assert main(["--target", str(root / "target"), "--drafter", str(tmp_path / "bad"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "vocab_size 1000 != target's 49152" in capsys.readouterr().err


def test_chat_template_kwargs_render_as_extraction_does(chat_pair):
    from dflashkit.extract.data.rendering import ChatConfig, render

    _, tokenizer = chat_pair
    qwen = tf.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    qwen.chat_template = QWEN3
    off = load_prompts("builtin:mtbench", qwen, 1, chat=ChatConfig(template_kwargs={"enable_thinking": False}))[0]
    on = load_prompts("builtin:mtbench", qwen, 1)[0]
    assert off.input_ids != on.input_ids  # the kwargs reach the template
    text = render(qwen, off.messages, ChatConfig(template_kwargs={"enable_thinking": False}), True)
    assert off.input_ids == qwen(text, add_special_tokens=False)["input_ids"]


def test_chat_template_kwargs_are_recorded_and_a_different_training_is_warned(chat_pair, tmp_path, capsys):
    import shutil

    root, _ = chat_pair
    shutil.copytree(root, tmp_path / "pair")
    config = tmp_path / "pair" / "drafter" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template_kwargs": {"enable_thinking": True}}))
    kwargs = '{"enable_thinking": false}'
    assert _run(tmp_path / "pair", tmp_path / "r", "--chat-template-kwargs", kwargs, "--baseline-prompts", "0") == 0
    assert 'trained with chat template kwargs {"enable_thinking": true}' in capsys.readouterr().err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["args"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert report["drafter"]["chat_template_kwargs"] == {"enable_thinking": True}
    assert _run(tmp_path / "pair", tmp_path / "r", "--chat-template-kwargs", "[1]") == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_chain_and_tree_share_the_baseline_in_one_process(chat_pair, tmp_path):
    from dflashkit.eval.options import EvalOptions
    from dflashkit.eval.run import run_eval

    root, _ = chat_pair
    shared = {}
    reports = [run_eval(EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"), out=tmp_path / mode,
                                    dataset=["builtin:mtbench"], mode=mode, max_new_tokens=NEW, tree_budget=6,
                                    tree_top_k=2, num_prompts=2, no_stop=True), shared_baseline=shared)
               for mode in ("chain", "tree")]
    assert sorted(k[0] for k in shared) == ["ar", "ar", "ref", "ref"]  # two prompts, each run once
    assert reports[0]["overall"]["ar_step_ms"] == reports[1]["overall"]["ar_step_ms"]
    assert all(r["overall"]["lossless"]["mismatches"] == 0 for r in reports)


def test_eval_renders_as_the_export_records_the_drafter_was_trained(chat_pair, tmp_path, capsys):
    """The export records the chat template and kwargs training rendered with (config.json); eval renders with
    them unless told otherwise, and its first line and report say which and from where."""
    import hashlib
    import shutil

    from dflashkit.drafter import load_drafter
    from dflashkit.eval.chat_settings import resolve_chat

    root, tokenizer = chat_pair
    persona = ("{% if persona is defined %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}"
               "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    kwargs = {"persona": "One line only."}
    shutil.copytree(root / "target", tmp_path / "pair" / "target")
    save_drafter(load_drafter(root / "drafter"), tmp_path / "pair" / "drafter",
                 chat={"chat_template": persona, "chat_template_kwargs": kwargs})
    recorded = json.loads((tmp_path / "pair" / "drafter" / "config.json").read_text())
    assert (recorded["chat_template"], recorded["chat_template_kwargs"]) == (persona, kwargs)
    chat = resolve_chat(tmp_path / "pair" / "drafter", None, None)
    assert (chat.config.chat_template, chat.config.template_kwargs) == (persona, kwargs)

    assert _run(tmp_path / "pair", tmp_path / "r", "--baseline-prompts", "0") == 0
    out = capsys.readouterr()
    sha = hashlib.sha256(persona.encode()).hexdigest()
    assert f"chat template sha256 {sha[:12]} (from {tmp_path / 'pair' / 'drafter'}/config.json)" in out.out
    assert "warning" not in out.err
    args = json.loads((tmp_path / "r" / "report.json").read_text())["args"]
    assert (args["chat_template_sha256"], args["chat_template_kwargs"]) == (sha, kwargs)
    assert f"chat template `{sha[:12]}` (from {tmp_path / 'pair' / 'drafter'}/config.json)" in (
        tmp_path / "r" / "report.md").read_text()
    prompt = load_prompts("builtin:mtbench", tokenizer, 1, chat=chat.config)[0]
    assert tokenizer.decode(prompt.input_ids).startswith("<|im_start|>system\nOne line only.<|im_end|>")

    assert _run(tmp_path / "pair", tmp_path / "s", "--chat-template-kwargs", "{}", "--baseline-prompts", "0") == 0
    out = capsys.readouterr()
    assert "kwargs {} (from --chat-template-kwargs)" in out.out and "trained with chat template kwargs" in out.err
