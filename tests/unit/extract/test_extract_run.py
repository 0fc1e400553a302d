"""`dflashkit extract` end to end on a tiny random Llama with the testbed's real tokenizer: stored features equal
Hugging Face's hidden_states[i + 1] of each sample alone; bad records are counted or fail per --on-bad; wrong
settings fail before any work; bytes per token per codec."""

import hashlib
import json

import pytest
import torch

from dflashkit.cli import run_main
from dflashkit.extract.__main__ import main as extract_main
from dflashkit.extract.data.chat import encode_record
from dflashkit.extract.data.rendering import ChatConfig
from dflashkit.extract.options import ExtractOptions
from dflashkit.extract.run import extract
from dflashkit.extract.shards.format import FP8_ABS_ERR, FP8_REL_ERR
from dflashkit.extract.shards.manifest import read_manifest
from dflashkit.extract.shards.reader import ShardDataset
from dflashkit.extract.shards.verify import verify_dataset

from support.chat_data import chat_records, save_tiny_chat_target, smollm2_tokenizer, write_jsonl
from support.chat_templates import QWEN3, supervised_runs
from support.tiny_targets import hf_model as _hf_model

LAYERS = [0, 2, 3]


def main(argv):
    """The command as `dflashkit extract` runs it: a user error is one line on stderr and exit status 2."""
    return run_main("dflashkit extract", extract_main, argv)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")


def reference_features(target_dir, input_ids, layer_ids):
    """hidden_states[i + 1] of one sample alone, concatenated, and the last (final-norm) state: plain HF."""
    model = _hf_model(target_dir)
    with torch.no_grad():
        hs = model(input_ids=input_ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], -1), hs[-1][0]


BAD = {3: '{"messages": [broken', 6: json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
       9: json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]})}


def test_extract_stores_each_samples_own_hidden_states(tiny, tmp_path):
    records = chat_records(9)
    data = write_jsonl(tmp_path / "d.jsonl", records, BAD.items())
    out = tmp_path / "out"
    rc = main(["--target", tiny, "--data", data, "--out", str(out), "--layer-ids", ",".join(map(str, LAYERS)),
               "--batch-tokens", "400", "--bucket-window", "5", "--shard-size", "20KB", "--store-last-hidden",
               "--no-progress"])
    assert rc == 0
    m = read_manifest(out)
    assert m["complete"] and m["target_layer_ids"] == LAYERS and m["hidden_size"] == 32
    assert {k: v for k, v in m["skipped"].items() if v} == {"malformed_json": 1, "no_assistant_turn": 1,
                                                           "unknown_role": 1}
    assert len(m["shards"]) >= 2 and verify_dataset(out) == ([], [])
    ds = ShardDataset(out)
    good = [k - 1 for k in range(1, 13) if k not in BAD]  # stable indices of the good records
    assert sorted(ds.sample_indices) == good
    tok, cfg = smollm2_tokenizer(), ChatConfig()
    for k in range(len(ds)):
        s = ds[k]
        record = records[good.index(s["sample_index"])]
        want = encode_record(record, tok, cfg)
        assert s["input_ids"].tolist() == want.input_ids and s["loss_mask"].tolist() == want.loss_mask
        hidden, last = reference_features(tiny, s["input_ids"], LAYERS)
        torch.testing.assert_close(s["hidden"].float(), hidden, rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(s["last_hidden"].float(), last, rtol=2 ** -7, atol=1e-5)


def test_fp8_codec_bytes_per_token_and_error(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(4))
    sizes = {}
    for codec in ("bf16", "fp8"):
        out = tmp_path / codec
        m = extract(ExtractOptions(target=tiny, data=[data], out=out, layer_ids=[0, 2, 3], codec=codec,
                                   progress=False))  # the library call
        assert m == read_manifest(out)
        sizes[codec] = m["totals"]["bytes_per_token"]
    ds = ShardDataset(tmp_path / "fp8")
    for k in range(len(ds)):
        s = ds[k]
        ref, _ = reference_features(tiny, s["input_ids"], LAYERS)
        amax = ref.abs().amax(-1, keepdim=True)
        assert ((s["hidden"].float() - ref).abs() <= 1.01 * (FP8_REL_ERR * ref.abs() + FP8_ABS_ERR * amax) + 1e-6).all()
    # 3 taps x hidden 32: bf16 2 bytes a value, fp8 1 byte + a 4-byte scale; + ids (4) + mask (1) + header share
    assert 197 <= sizes["bf16"] < 260 and 101 <= sizes["fp8"] < 160


def test_on_bad_fail_names_file_and_line(tiny, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(9), BAD.items())
    rc = main(["--target", tiny, "--data", data, "--out", str(tmp_path / "out"), "--on-bad", "fail", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{data}:3: malformed_json" in err and "--on-bad skip" in err


def test_wrong_settings_fail_before_any_work(tiny, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    out = tmp_path / "out"
    assert main(["--target", tiny, "--data", data, "--out", str(out), "--layer-ids", "1,4", "--no-progress"]) == 2
    assert "outside 0..3" in capsys.readouterr().err and not list(out.glob("*"))
    assert main(["--target", tiny, "--data", data, "--out", str(out), "--no-progress", "--layer-ids", "1,2"]) == 0
    assert main(["--target", tiny, "--data", data, "--out", str(out), "--no-progress", "--layer-ids", "1,2"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["--target", tiny, "--data", data, "--out", str(out), "--no-progress", "--layer-ids", "1,2",
                 "--codec", "fp8", "--resume"]) == 2
    assert "codec='bf16'" in capsys.readouterr().err
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert main(["--target", tiny, "--data", data, "--out", str(tmp_path / "o2"), "--chat-template", str(plain),
                 "--no-progress"]) == 2
    assert "cannot mark assistant spans" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's refusal, before the target is loaded
        main(["--target", tiny, "--data", data, "--out", str(tmp_path / "o3"), "--tokenize-workers", "many"])
    assert "--tokenize-workers: 'many': use auto or a count >= 0 (0: inline)" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()


def test_template_flags_workers_dtype_and_progress(tiny, tmp_path, capsys):

    records = chat_records(6, seed=3)
    data = write_jsonl(tmp_path / "d.jsonl", records)
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    flags = ["--target", tiny, "--data", data, "--layer-ids", "1,3", "--chat-template", str(template),
             "--chat-template-kwargs", '{"enable_thinking": false}', "--bucket-window", "4"]
    assert main([*flags, "--out", str(tmp_path / "a"), "--no-progress", "--device-map", "cpu",
                 "--trust-remote-code"]) == 0
    # two tokenizing processes and a bfloat16 target give the same samples (features up to bf16 rounding)
    assert main([*flags, "--out", str(tmp_path / "b"), "--tokenize-workers", "2", "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "tok/s" in err and "extract: 6 samples" in err and "bytes/token (bf16)" in err
    a, b = ShardDataset(tmp_path / "a"), ShardDataset(tmp_path / "b")
    assert a.manifest["template_kwargs"] == {"enable_thinking": False}
    assert a.manifest["chat_template_hash"] == hashlib.sha256(QWEN3.encode()).hexdigest()
    assert a.manifest["dtype"] == "float32" and b.manifest["dtype"] == "bfloat16"
    tok, cfg = smollm2_tokenizer(), ChatConfig(chat_template=QWEN3, template_kwargs={"enable_thinking": False})
    by_index = {b[k]["sample_index"]: b[k] for k in range(len(b))}
    for k in range(len(a)):
        s, t = a[k], by_index[a[k]["sample_index"]]
        want = encode_record(records[s["sample_index"]], tok, cfg)
        assert s["input_ids"].tolist() == want.input_ids == t["input_ids"].tolist()
        answers = [m["content"] + "<|im_end|>" for m in records[s["sample_index"]]["messages"]
                   if m["role"] == "assistant"]
        assert supervised_runs(tok, want) == answers
        torch.testing.assert_close(t["hidden"].float(), s["hidden"].float(), rtol=0.05, atol=0.05)
