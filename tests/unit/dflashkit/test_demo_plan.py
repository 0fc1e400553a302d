"""`dflashkit demo` without flags runs at this machine's scale (the GPU scale where CUDA is available, the CPU check
elsewhere); explicit flags win. CUDA's availability is passed in, as main passes launch.local_device's answer."""

import pytest

from dflashkit.demo import GPU_SCALE_MEASURED, demo_plan, plan_line


@pytest.mark.parametrize("device, scale, cuda, chosen", [
    (None, None, True, ("cuda", "full")),  # `make demo` on a GPU machine: the GPU scale by itself
    (None, None, False, ("cpu", "small")),  # on the CPU: the pipeline check
    ("cpu", None, True, ("cpu", "small")),  # an explicit device wins, its scale follows it
    ("cuda", None, False, ("cuda", "full")),
    (None, "small", True, ("cuda", "small")),  # an explicit scale wins
    ("cuda", "small", True, ("cuda", "small")),
    ("cpu", "full", False, ("cpu", "full")),
])
def test_the_demo_runs_at_the_scale_of_its_device(device, scale, cuda, chosen):
    assert demo_plan(device, scale, cuda_available=cuda) == chosen


def test_the_demo_says_what_it_chose():
    assert "GPU scale (--device cuda --scale full), chosen for this machine" in plan_line("cuda", "full", True)
    cpu = plan_line("cpu", "small", True)
    assert "pipeline check" in cpu and "docs/results.md" in cpu and GPU_SCALE_MEASURED in cpu
    assert plan_line("cpu", "full", False).endswith("as the flags say")


def test_the_cpu_table_says_it_is_the_pipeline_check(tmp_path):
    import json

    from dflashkit.demo import summary

    (tmp_path / "eval-chain").mkdir()
    (tmp_path / "eval-chain" / "report.json").write_text(json.dumps({"overall": {"tau": 1.2}}))
    assert "This is the pipeline check" in summary(tmp_path, "small")
    assert "The GPU scale (`make demo` on a CUDA machine) has its latest measurement in the repository's " \
           "docs/results.md" in summary(tmp_path, "small")
    assert "This is the GPU scale" in summary(tmp_path, "full")


def test_the_demo_parser_is_built_from_its_options_and_a_parse_gives_them():
    from dflashkit.demo import TARGET, DemoOptions, build_parser
    from dflashkit.options import flag_fields, flag_name, parse_options

    parser = build_parser()
    assert [a.option_strings[0] for a in parser._actions if a.dest != "help"] == [
        flag_name(f) for f in flag_fields(DemoOptions)]
    assert parse_options(DemoOptions, [], parser) == DemoOptions(
        run_dir="runs/demo", device=None, target=TARGET, scale=None, train_data="builtin:sharegpt", eval_data=None,
        loss=None, restart=False)
    given = parse_options(DemoOptions, ["--device", "cpu", "--scale", "small", "--eval-data", "a", "b", "--loss",
                                        "kl", "--restart"], parser)
    assert (given.device, given.scale, given.eval_data, given.loss, given.restart) == (
        "cpu", "small", ["a", "b"], "kl", True)
