"""Issue 68 item 4: the serve commands an `eval --engine vllm` report prints start servers that `eval --server`
sweeps, reads back and puts beside the in-process engines: the command printed is the one whose numbers are
reported. In-process: the CPU twin of vllm.LLM; servers: the same twin behind an OpenAI-compatible HTTP server
started from the command line itself (tests/support/standin_server.py)."""

import json

import pytest

from dflashkit.errors import UserError
from dflashkit.eval.options import EvalOptions
from dflashkit.eval.serving import run_sweep
from dflashkit.eval.vllm_engine import VllmEvalConfig, run_vllm_eval

from support.standin_server import CommandError, parse_serve_command, start_standin_server, stop_standin_server
from support.vllm_pairs import standin_api, write_pair

pytestmark = pytest.mark.usefixtures("one_thread")

LEVELS = [1, 2]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    root = write_pair(tmp_path_factory.mktemp("served_pair"), 4, causal=True)
    config = VllmEvalConfig(concurrency=LEVELS, num_speculative_tokens=[1, 3], prefix_caching=["on"],
                            max_new_tokens=4, use_stop_tokens=False, repeats=1)
    out = root / "engine"
    report = run_vllm_eval(EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"), out=out,
                                       dataset=[str(root / "chats.jsonl")], num_prompts=4), config, api=standin_api())
    return root, out, report


def sweep_servers(root, out, commands: dict[str, str], tmp_path, server_info: bool = True) -> dict:
    started = {name: start_standin_server(command, server_info) for name, command in commands.items()}
    try:
        return run_sweep(EvalOptions(server=[f"{name}={url}" for name, (_, url) in started.items()],
                                     dataset=[str(root / "chats.jsonl")], num_prompts=4, concurrency=LEVELS,
                                     max_new_tokens=4, out=tmp_path / "served", engine_report=str(out)))
    finally:
        for httpd, _ in started.values():
            stop_standin_server(httpd)


def test_the_printed_commands_start_the_servers_whose_numbers_are_reported(engine_run, tmp_path):
    root, out, report = engine_run
    schedule = json.loads((out / "schedule.json").read_text())
    commands = {"none": report["engines"]["none"]["serve_command"], "k3": report["engines"]["k3"]["serve_command"],
                schedule["engine"]: schedule["serve_command"]}
    # the schedule's command names everything its engine was given: the schedule, N, max_num_seqs, the graphs
    parsed = parse_serve_command(schedule["serve_command"])
    assert parsed.speculative_config == report["engines"][schedule["engine"]]["speculative_config"]
    assert parsed.speculative_config["num_speculative_tokens_per_batch_size"] == \
        schedule["num_speculative_tokens_per_batch_size"]
    assert (parsed.max_num_seqs, parsed.dtype) == (max(LEVELS), "bfloat16")
    assert parsed.model == report["target"]["served_dir"]
    plan = sweep_servers(root, out, commands, tmp_path)
    beside = plan["beside_engine"]
    assert set(beside) == set(commands)
    for name, entry in beside.items():
        assert entry["served"]["read"] and entry["differences"] == [], (name, entry)
        assert entry["serve_command"] == commands[name]
        for c in map(str, LEVELS):  # each server's cell beside its in-process engine's
            assert entry["levels"][c]["server_tokens_per_s"] == plan["engines"][name][c]["output_tokens_per_s"]
            assert entry["levels"][c]["in_process_tokens_per_s"] == \
                report["engines"][name]["levels"][c]["output_tokens_per_s"]
    served = plan["served"][schedule["engine"]]["speculative_config"]
    assert served["num_speculative_tokens_per_batch_size"] == schedule["num_speculative_tokens_per_batch_size"]
    md = (tmp_path / "served" / "serving.md").read_text()
    assert f"serves the report's engine: speculative_config `{json.dumps(served)}`" in md
    assert f"started with `{schedule['serve_command']}`" in md and "| tok/s server | tok/s in-process |" in md


def test_a_server_serving_otherwise_is_named(engine_run, tmp_path):
    """A server started from another engine's command under the schedule's name is reported as serving otherwise;
    one without /server_info as not read back."""
    root, out, report = engine_run
    schedule = json.loads((out / "schedule.json").read_text())
    plan = sweep_servers(root, out, {"none": report["engines"]["none"]["serve_command"],
                                     schedule["engine"]: report["engines"]["k3"]["serve_command"]}, tmp_path)
    wrong = plan["beside_engine"][schedule["engine"]]["differences"]
    assert any(d.startswith("num_speculative_tokens_per_batch_size null where the engine had") for d in wrong)
    blind = sweep_servers(root, out, {"none": report["engines"]["none"]["serve_command"],
                                      "k1": report["engines"]["k1"]["serve_command"]}, tmp_path / "blind", False)
    assert not blind["served"]["k1"]["read"] and "VLLM_SERVER_DEV_MODE=1" in blind["served"]["k1"]["why"]
    assert blind["beside_engine"]["k1"]["differences"] is None


def test_engine_reports_and_commands_are_checked(engine_run, tmp_path):
    root, out, _ = engine_run
    with pytest.raises(CommandError, match="--port"):
        parse_serve_command(f"vllm serve {root / 'target'} --port 1")
    from dflashkit.eval.__main__ import main

    with pytest.raises(UserError, match="--engine-report is read by --server"):
        main(["--target", "t", "--drafter", "d", "--out", str(tmp_path / "x"), "--engine-report", str(out)])
    with pytest.raises(UserError, match="needs NAME=URL servers"):
        run_sweep(EvalOptions(server=["http://127.0.0.1:9"], dataset=[str(root / "chats.jsonl")], num_prompts=1,
                              concurrency=[1], max_new_tokens=2, engine_report=str(out)))
    (tmp_path / "chain").mkdir()
    (tmp_path / "chain" / "report.json").write_text(json.dumps(
        {"args": {}, "block_size": 4, "datasets": {}, "overall": {"tau": 1.5}}))
    with pytest.raises(UserError, match="not a report of `dflashkit eval --engine vllm`"):
        run_sweep(EvalOptions(server=["none=http://127.0.0.1:9", "k3=http://127.0.0.1:9"],
                              dataset=[str(root / "chats.jsonl")], num_prompts=1, concurrency=[1], max_new_tokens=2,
                              engine_report=str(tmp_path / "chain")))


def test_a_schedule_of_zeros_keeps_its_command(engine_run, tmp_path):
    """schedule.json's command is the schedule's engine as measured, even when the schedule says k = 0 everywhere
    (it used to drop the speculative_config, naming an engine that was never measured)."""
    root, _, _ = engine_run
    config = VllmEvalConfig(concurrency=[1], num_speculative_tokens=[1], prefix_caching=["on"], max_new_tokens=2,
                            use_stop_tokens=False, repeats=1, schedule=[[1, 1, 0]])
    run_vllm_eval(EvalOptions(target=str(root / "target"), drafter=str(root / "drafter"), out=tmp_path,
                              dataset=[str(root / "chats.jsonl")], num_prompts=2), config, api=standin_api())
    written = json.loads((tmp_path / "schedule.json").read_text())
    parsed = parse_serve_command(written["serve_command"])
    assert parsed.speculative_config == written["speculative_config"]
    assert parsed.speculative_config["num_speculative_tokens_per_batch_size"] == [[1, 1, 0]]


def test_bench_vllm_starts_its_servers_from_the_printed_commands(engine_run, tmp_path):
    """bench_vllm.py --parts server, after --parts serve: each `vllm serve` it starts is the command the serve
    part's report prints (none, the largest k, schedule.json's), on loopback with the engines' GPU share."""
    import shlex
    import shutil
    import sys
    from types import SimpleNamespace

    from support.paths import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_vllm as bench

    _, out, report = engine_run
    shutil.copytree(out, tmp_path / "serve")
    commands = bench.report_servers(SimpleNamespace(gpu_memory_utilization=0.25), tmp_path)
    schedule = json.loads((out / "schedule.json").read_text())
    printed = {"none": report["engines"]["none"]["serve_command"], "k3": report["engines"]["k3"]["serve_command"],
               schedule["engine"]: schedule["serve_command"]}
    assert set(commands) == set(printed)
    for name, cmd in commands.items():
        words = shlex.split(printed[name])[2:]
        assert cmd[4:4 + len(words)] == words and cmd[4 + len(words):] == [
            "--host", "127.0.0.1", "--port", str(cmd[cmd.index("--port") + 1]), "--gpu-memory-utilization", "0.25"]
    assert len({cmd[cmd.index("--port") + 1] for cmd in commands.values()}) == 3
    assert bench.report_servers(SimpleNamespace(gpu_memory_utilization=0.25), tmp_path / "nothing") is None
