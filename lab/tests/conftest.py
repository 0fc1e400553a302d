"""The lab's tests share the fixtures and hooks of tests/conftest.py (one torch thread, the scratch folder, the
accelerate state reset, the seed, the longest-first order): pytest reads a conftest.py only in the folders above a
test, so lab/tests/ loads that one as a plugin, by its module name on pyproject.toml's test path (tests/)."""

pytest_plugins = ["conftest"]
