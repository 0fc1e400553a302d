"""Where the tests find the repository."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/support/ is two levels down)
TINY_RECIPE = ROOT / "recipes" / "tiny.yaml"  # the training settings of the tiny target (tests, smoke runs)
