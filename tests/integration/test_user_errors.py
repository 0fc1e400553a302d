"""Bad input is one line on stderr and exit status 2, naming the file, field or URL and the fix, and it stops before
a target is loaded where it can: an output path that is a file, cut or damaged data files, an empty data file, an
unreachable or foreign server, a damaged index.json, counts out of range. (Malformed shard manifests:
tests/unit/dflashkit/test_untrusted_manifests.py.)"""

import gzip
import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from dflashkit.cli import main as cli
from dflashkit.errors import UserError
from dflashkit.extract.data.rendering import read_chat_template
from dflashkit.extract.data.sources import iter_records
from dflashkit.train.recipe import load_config

from support.chat_data import chat_records, write_jsonl
from support.paths import ROOT
from support.tiny_targets import make_tiny_target

NO_TARGET = "no-such-target-dir"  # a run that got as far as loading a target would fail on this name instead


def error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err[-2000:]
    return lines[0]


def extract_argv(data, out) -> list[str]:
    return ["extract", "--target", NO_TARGET, "--data", str(data), "--out", str(out), "--no-progress"]


# ----------------------------------------------------------------------------- output paths
def test_an_output_path_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    in_the_way = tmp_path / "out"
    in_the_way.write_text("my notes")
    assert cli(extract_argv(data, in_the_way)) == 2
    line = error_line(capsys, "dflashkit extract")
    assert f"{in_the_way}: a file is in the way" in line and NO_TARGET not in line
    assert cli(["train", f"shards={tmp_path / 'shards'}", f"output_dir={in_the_way}"]) == 2
    assert f"{in_the_way}: a file is in the way" in error_line(capsys, "dflashkit train")
    assert in_the_way.read_text() == "my notes"


# ----------------------------------------------------------------------------- data files
def test_a_cut_gzip_names_the_file_and_keeps_the_records_before_the_cut(tmp_path, capsys):
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in chat_records(40)).encode())
    cut = tmp_path / "chats.jsonl.gz"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    items = []
    with pytest.raises(ValueError, match=rf"{cut}: the compressed data is cut or damaged after line \d+"):
        for item in iter_records(str(cut)):
            items.append(item)
    assert 0 < len(items) < 40 and all(i.record is not None for i in items)
    cut.write_bytes(whole[:30])  # cut inside the first record: stops before the target is loaded
    assert cli(extract_argv(cut, tmp_path / "out")) == 2
    assert f"{cut}: the compressed data is cut or damaged" in error_line(capsys, "dflashkit extract")


def test_a_damaged_parquet_file_is_named(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [f"record {i}" for i in range(5)]}), good)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(good.read_bytes()[:-20])  # the footer is gone
    with pytest.raises(ValueError, match=rf"{bad}: not a readable Parquet file at row 0"):
        list(iter_records(str(bad)))
    assert cli(extract_argv(bad, tmp_path / "out")) == 2
    assert f"{bad}: not a readable Parquet file" in error_line(capsys, "dflashkit extract")


def test_an_empty_data_file_is_an_error_before_any_target_is_loaded(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli(extract_argv(empty, tmp_path / "out")) == 2
    line = error_line(capsys, "dflashkit extract")
    assert f"data {empty}: no record" in line and NO_TARGET not in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert cli(["train", "--target", NO_TARGET, "--data", str(empty), f"output_dir={tmp_path / 'run'}",
                "wandb=false", "progress=false"]) == 2
    line = error_line(capsys, "dflashkit train")
    assert f"data {empty}: no record" in line and NO_TARGET not in line
    assert cli(["regenerate", "--target", NO_TARGET, "--data", str(empty), "--out", str(tmp_path / "r.jsonl")]) == 2
    line = error_line(capsys, "dflashkit regenerate")
    assert f"data {empty}: no record" in line and NO_TARGET not in line


def test_a_chat_template_file_that_is_not_there_is_one_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records(2))
    missing = tmp_path / "no-such-template.jinja"
    assert cli([*extract_argv(data, tmp_path / "out"), "--chat-template", str(missing)]) == 2
    line = error_line(capsys, "dflashkit extract")
    assert f"--chat-template {missing}: cannot be read (No such file or directory)" in line and NO_TARGET not in line
    with pytest.raises(UserError, match=f"chat_template {tmp_path}: cannot be read"):  # train's field: a directory
        read_chat_template(str(tmp_path), flag="chat_template")


# ----------------------------------------------------------------------------- servers
def test_eval_against_a_server_that_is_not_there_is_one_line(tmp_path):
    """Nothing listens on port 9 (discard): connection refused. In a subprocess: a network call must not hang."""
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(2))
    proc = subprocess.run([sys.executable, "-m", "dflashkit", "eval", "--server", "http://127.0.0.1:9", "--dataset",
                           prompts, "--num-prompts", "1", "--concurrency", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("dflashkit eval: error: http://127.0.0.1:9/v1/models: no answer") and \
        "start the server" in lines[0]


class _Answer(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 (the http.server name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("body,said", [
    (b"<html>not an API</html>", "the answer is not JSON"),
    (b'{"data": 5}', 'expected {"data": [{"id": MODEL}, ...]}'),
    (b'[{"id": "m"}]', 'expected {"data": [{"id": MODEL}, ...]}'),
    (b'{"data": [{"name": "m"}]}', 'expected {"data": [{"id": MODEL}, ...]}'),
])
def test_a_server_answering_something_else_is_named(tmp_path, capsys, body, said):
    handler = type("Handler", (_Answer,), {"body": body})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(2))
        assert cli(["eval", "--server", url, "--dataset", prompts, "--num-prompts", "1", "--concurrency", "1",
                    "--timeout", "10"]) == 2
        line = error_line(capsys, "dflashkit eval")
        assert f"{url}/v1/models: " in line and said in line
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- damaged files of a target
def test_a_target_index_that_is_not_json_names_the_file(tmp_path):
    from dflashkit.targets.loading import load_target_head

    target = make_tiny_target(tmp_path / "t")
    (target / "model.safetensors.index.json").write_text("{cut")
    with pytest.raises(ValueError, match=r"t/model\.safetensors\.index\.json: not valid JSON"):
        load_target_head(str(target))


def test_a_target_config_that_is_not_json_names_the_file(tmp_path, capsys):
    target = make_tiny_target(tmp_path / "t")
    (target / "config.json").write_text('{"model_type": "llama",')  # cut
    capsys.readouterr()  # the progress of saving the target
    assert cli(["init-drafter", "--target", str(target), "--out", str(tmp_path / "d")]) == 2
    assert f"{target / 'config.json'}: not valid JSON" in error_line(capsys, "dflashkit init-drafter")


# ----------------------------------------------------------------------------- counts
@pytest.mark.parametrize("field,value,said", [
    ("max_steps", -3, "max_steps must be >= 0 (0: the epochs decide), got -3"),
    ("eval_samples", -1, "eval_samples must be >= 0"),
    ("save_every", -5, "save_every must be >= 0"),
    ("eval_every", -1, "eval_every must be >= 0"),
    ("data_limit", -2, "data_limit must be >= 0"),
    ("num_workers", -1, "num_workers must be >= 0"),
    ("tokenize_workers", -1, "tokenize_workers must be auto or a count >= 0 (0: inline), got -1"),
    ("tokenize_workers", "many", "tokenize_workers: 'many' is neither auto nor a whole number"),
    ("log_every", 0, "log_every must be >= 1"),
    ("eval_anchors", 0, "eval_anchors must be >= 1"),
    ("max_length", 0, "max_length must be >= 1"),
    ("lr", -1e-4, "lr must be >= 0"),
    ("selector_weights", "dpace", "selector_weights: 'dpace'; use 'decay' or 'loss'"),
    ("selector_missing_label", "drop", "selector_missing_label: 'drop'; use 'skip' or 'inject'"),
    ("selector_codebook_lr_scale", 0, "selector_codebook_lr_scale must be > 0 (a multiple of lr), got 0"),
])
def test_counts_are_checked_in_the_config(field, value, said, capsys, tmp_path):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"{field}={value}"])
    assert cli(["train", f"shards={tmp_path}", f"{field}={value}"]) == 2
    assert said in error_line(capsys, "dflashkit train")


def test_a_value_that_is_not_yaml_is_one_line(capsys, tmp_path):
    assert cli(["train", f"shards={tmp_path}", "target_layer_ids=[1,2"]) == 2
    assert "override 'target_layer_ids=[1,2': the value is not YAML" in error_line(capsys, "dflashkit train")
