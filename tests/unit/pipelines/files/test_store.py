"""The model-file cache's own writes (pipelines/files/store.py): directories made for it are
writable by their owner alone, whatever the umask (``config.model_cache`` refuses others)."""

from __future__ import annotations

import os

import pytest

from config.errors import ConfigError
from config.model_cache import own_problem
from pipelines.files.store import make_dirs

ME = os.geteuid()


def test_directories_made_for_the_cache_are_writable_by_their_owner_alone(tmp_path):
    old = os.umask(0o002)
    try:
        make_dirs(tmp_path / "a" / "b" / "cache")
    finally:
        os.umask(old)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "cache"):
        assert directory.stat().st_mode & 0o022 == 0, directory
    assert own_problem(tmp_path / "a" / "b" / "cache", ME) is None


def test_a_cache_directory_another_account_made_first_is_refused_once_made(tmp_path):
    """A cache dir under a sticky shared directory is accepted before it exists; should
    another account create it first, making it finds it theirs and refuses it."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    cache = shared / "cache"
    assert own_problem(cache, ME) is None
    cache.mkdir(mode=0o777)  # "another account's": writable by all, as a stranger's would be
    cache.chmod(0o777)
    with pytest.raises(ConfigError, match="is not this worker's own"):
        make_dirs(cache)
