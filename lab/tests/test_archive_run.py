"""lab/archive_run.py: a run folder (or one result file) becomes one xz archive and a summary JSON, the same bytes
each time; the index lists every summary, newest first; a missing run is a one-line error, exit 2."""

import json
import tarfile

from lab.archive_run import archive_run, main, write_index


def make_run(folder):
    (folder / "vllm").mkdir(parents=True)
    (folder / "stages.txt").write_text("[10:00:00] train: rc=0 12 s\nall done\n")
    (folder / "vllm" / "a_tau.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "tau": 2.1}))
    return folder


def test_a_run_folder_round_trips_through_its_archive(tmp_path):
    run = make_run(tmp_path / "ttq_h100_1207")
    summary = archive_run(run, tmp_path / "results", "time to quality at 2,000 steps", date="2026-12-07")
    archive = tmp_path / "results" / "ttq_h100_1207.tar.xz"
    with tarfile.open(archive, "r:xz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert members == {"ttq_h100_1207/stages.txt": (run / "stages.txt").read_bytes(),
                       "ttq_h100_1207/vllm/a_tau.json": (run / "vllm" / "a_tau.json").read_bytes()}
    written = json.loads((tmp_path / "results" / "ttq_h100_1207.json").read_text())
    assert written == summary
    assert summary["card"] == "NVIDIA H100 80GB HBM3" and summary["date"] == "2026-12-07"
    assert summary["archive"] == "ttq_h100_1207.tar.xz"
    assert summary["members"]["ttq_h100_1207/stages.txt"] == (run / "stages.txt").stat().st_size
    first = archive.read_bytes()
    (run / "stages.txt").touch()  # a newer mtime: the archive must not change
    archive_run(run, tmp_path / "results", "time to quality at 2,000 steps", date="2026-12-07")
    assert archive.read_bytes() == first


def test_a_single_file_run_and_the_card_from_the_name(tmp_path):
    result = tmp_path / "extract_cpu_1205.json"
    result.write_text('{"tokens_per_s": 5.0}')
    summary = archive_run(result, tmp_path / "results", "extraction throughput", date="2026-12-05")
    assert summary["run"] == "extract_cpu_1205" and summary["card"] == "CPU"
    assert list(summary["members"]) == ["extract_cpu_1205.json"]
    bare = tmp_path / "misc.json"
    bare.write_text("{}")
    assert archive_run(bare, tmp_path / "results", "nothing", date="2026-12-06")["card"] == "unrecorded"


def test_the_index_lists_every_run_newest_first(tmp_path):
    results = tmp_path / "results"
    archive_run(make_run(tmp_path / "old_run"), results, "the older | one", date="2026-12-01")
    archive_run(make_run(tmp_path / "new_run"), results, "the newer one", date="2026-12-06")
    rows = [line for line in write_index(results).read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| new_run", "| old_run"]
    assert "the older / one" in rows[1] and "[old_run.tar.xz](old_run.tar.xz)" in rows[1]


def test_a_missing_run_is_a_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere"), "--measured", "x", "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nowhere: no such run folder or file" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "results").exists()
