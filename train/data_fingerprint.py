"""What data a training run reads, kept in every checkpoint (trainer.json ``data``), so a resume on other data is
refused instead of silently continuing a run on a dataset it did not start with.

Design choices:
- Online (``data=``): each input's bytes and sha256 (extract/data/sources.py ``describe_sources``; a directory's
  over its files) and ``data_limit``. Compared by content: the same files under another path, or moved, resume.
- Shards: the sha256 of every shard as the manifest lists it (extraction wrote them; nothing is read again) and
  the sample count; the same shards copied elsewhere resume.
- Online against shards (or the other way) is other data: the two paths number the same records alike, but the
  run cannot tell that the shards were extracted from the data it trained on.
- ``resume_other_data=true`` is the user's word that the change is meant (a curriculum's next stage, a cleaned
  file): the run says what differs and continues. A checkpoint written before the fingerprint existed resumes
  with a note that its data was not checked.
"""

from __future__ import annotations

import hashlib

from dflashkit.errors import UserError


def data_fingerprint(cfg, manifest: dict | None) -> dict:
    """The run's data: its online inputs (``cfg.data``) or the shards of ``manifest`` (a ShardDataset's)."""
    if cfg.data:
        from dflashkit.extract.data.sources import check_sources, describe_sources

        check_sources(list(cfg.data))  # an input given twice, or one that can be read only once: its own message
        return {"kind": "online", "inputs": describe_sources(list(cfg.data)), "data_limit": int(cfg.data_limit)}
    digests = "\n".join(sorted(str(s.get("sha256")) for s in manifest["shards"]))
    return {"kind": "shards", "samples": sum(int(s["samples"]) for s in manifest["shards"]),
            "sha256": hashlib.sha256(digests.encode()).hexdigest()}


def _described(fingerprint: dict) -> str:
    if fingerprint.get("kind") == "shards":
        return f"shards of {fingerprint.get('samples')} samples (sha256 {str(fingerprint.get('sha256'))[:12]}…)"
    names = ", ".join(str(e.get("spec")) for e in fingerprint.get("inputs") or [])
    return f"online data {names}"


def data_difference(saved: dict, current: dict) -> str | None:
    """How the run's data ``current`` differs from the checkpoint's ``saved``, in words; None when it is the same."""
    from dflashkit.extract.data.sources import data_difference as inputs_difference

    if saved.get("kind") != current["kind"] or saved.get("kind") == "shards" and (
            saved.get("samples"), saved.get("sha256")) != (current["samples"], current["sha256"]):
        return f"it was trained on {_described(saved)}, this run reads {_described(current)}"
    if current["kind"] == "shards":
        return None
    if saved.get("data_limit") != current["data_limit"]:
        return f"it was trained with data_limit={saved.get('data_limit')}, this run has {current['data_limit']}"
    return inputs_difference(saved.get("inputs") or [], current["inputs"])


def check_same_data(saved: dict | None, current: dict, source, allow_other: bool, say=print) -> None:
    """Refuse (UserError naming the checkpoint's trainer.json ``source`` and what differs) a resume whose data is
    not the checkpoint's, unless ``allow_other`` (resume_other_data=true), which is said; a checkpoint without
    a fingerprint is noted."""
    if saved is None:
        say(f"note: {source} records no data fingerprint (written before dflashkit kept one); the data of this "
            f"resume is not checked against it")
        return
    if not isinstance(saved, dict):
        raise UserError(f"{source}: field data is {saved!r:.60}, expected an object; the checkpoint was altered: use "
                        f"another checkpoint")
    differs = data_difference(saved, current)
    if differs is None:
        return
    if allow_other:
        say(f"resume_other_data=true: resuming {source.parent.name} on other data ({differs})")
        return
    raise UserError(f"{source}: the checkpoint was trained on other data: {differs}; resume with the data it was "
                    f"trained on, start a new run in another output_dir, or set resume_other_data=true to continue "
                    f"on this data")
