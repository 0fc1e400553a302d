"""The order `make test` sends test files to its workers in (tests/support/file_seconds.py), next to the layout
rules of tests/integration/test_tests_layout.py."""

import json

from support.file_seconds import SECONDS_FILE, file_of, load_seconds, longest_first, seconds_per_file


def test_junit_class_names_map_to_their_files():
    assert file_of("tests.unit.eval.test_eval_cli") == "tests/unit/eval/test_eval_cli.py"
    assert file_of("tests.unit.train.test_train_step.TestSomething") == "tests/unit/train/test_train_step.py"


def test_longest_files_first_and_unmeasured_ones_count_as_the_median():
    seconds = {"a.py": 10.0, "b.py": 50.0, "c.py": 30.0}
    # new.py counts as the median (30 s) and stays before c.py: ties keep pytest's order
    assert longest_first(["a.py", "new.py", "b.py", "c.py"], seconds) == ["b.py", "new.py", "c.py", "a.py"]
    assert longest_first(["x.py", "y.py"], {}) == ["x.py", "y.py"]  # nothing measured: pytest's order


def test_seconds_are_summed_per_file(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.unit.test_a" name="t1" time="1.25"/>'
                   '<testcase classname="tests.unit.test_a.TestK" name="t2" time="2.5"/>'
                   '<testcase classname="tests.integration.test_b" name="t3" time="0.5"/>'
                   '</testsuite></testsuites>')
    assert seconds_per_file(str(xml)) == {"tests/unit/test_a.py": 3.8, "tests/integration/test_b.py": 0.5}
    broken = tmp_path / "seconds.json"
    broken.write_text("{not json")
    assert load_seconds(broken) == {}


def test_the_committed_list_names_existing_test_files():
    seconds = json.loads(SECONDS_FILE.read_text())
    root = SECONDS_FILE.parents[1]
    missing = [name for name in seconds if not (root / name).is_file()]
    assert not missing, f"{missing}: gone from tests/; refresh tests/file_seconds.json (tests/support/file_seconds.py)"
