"""Fixtures of the training tests (helpers: tests/support/training.py)."""

import pytest

from support.training import extract_chat_run


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """(tiny target with the testbed tokenizer, chat jsonl with two bad lines, shards extracted from it): the same
    samples for online and offline training (support/training.py: extract_chat_run, online_overrides)."""
    return extract_chat_run(tmp_path_factory.mktemp("online"))
