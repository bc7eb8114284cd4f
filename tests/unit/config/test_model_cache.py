"""The model-file cache must be the worker's own (config/model_cache.py): one another account
owns, or that group or others may write (or a directory above it, unless sticky), is refused
naming it and the fix; ``run``, ``check`` and ``models fetch`` refuse it at start."""

from __future__ import annotations

import os

import pytest

from config.errors import ConfigError
from config.settings import load_settings

ME = os.geteuid()


def test_a_directory_of_the_workers_own_is_taken(tmp_path):
    from config.model_cache import own_problem

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    assert own_problem(cache, ME) is None
    assert own_problem(tmp_path / "not" / "yet", ME) is None  # made in a directory of ours


def test_a_directory_others_may_write_is_refused_naming_it_and_the_fix(tmp_path):
    from config.model_cache import own_problem

    cache = tmp_path / "cache"
    cache.mkdir()
    for mode in (0o777, 0o1777, 0o2777):  # group-write alone: see the setgid test
        cache.chmod(mode)
        problem = own_problem(cache, ME)
        assert problem is not None, oct(mode)
        assert f"WORKER_MODEL__CACHE_DIR: {cache} is not this worker's own" in problem
        assert "writable by group or others" in problem and f"chmod go-w {cache}" in problem


def test_a_parent_others_may_write_is_refused_unless_sticky(tmp_path):
    from config.model_cache import own_problem

    shared = tmp_path / "shared"
    (shared / "cache").mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)  # another account could swap the cache directory for its own
    assert f"{shared} is writable by group or others" in (own_problem(shared / "cache", ME) or "")
    assert "chmod" not in (own_problem(shared / "cache", ME) or "")  # never on a shared one
    shared.chmod(0o1777)  # as /tmp is: nobody but its owner removes or renames what is in it
    assert own_problem(shared / "cache", ME) is None
    shared.chmod(0o777)
    assert own_problem(shared / "missing", ME) is not None  # would be made in a shared place


def test_a_cache_not_yet_made_under_a_sticky_shared_directory_is_taken(tmp_path):
    """As /tmp/cache: the worker makes it itself (mode 700), and checks it again once made;
    it never advises chmod on /tmp."""
    from config.model_cache import own_problem

    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    assert own_problem(shared / "cache", ME) is None
    assert own_problem(shared / "a" / "cache", ME) is None


def test_a_setgid_group_writable_cache_of_the_workers_own_group_is_taken(tmp_path):
    """Kubernetes' fsGroup and OpenShift's g=u give the volume mode 2775 and a group of the
    process; the same mode with another group is refused."""
    from config.model_cache import own_problem

    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o2775)
    gid = cache.stat().st_gid
    assert own_problem(cache, ME, groups={gid}) is None
    assert os.getegid() != gid or own_problem(cache, ME) is None  # the default: our groups
    problem = own_problem(cache, ME, groups={gid + 1})
    assert problem is not None and "writable by group or others" in problem
    cache.chmod(0o2777)  # others may write: refused whatever the group
    assert own_problem(cache, ME, groups={gid}) is not None


def test_a_directory_another_uid_owns_is_refused(tmp_path):
    from config.model_cache import own_problem

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    if ME == 0:  # root may give it away; root itself is trusted
        os.chown(cache, 4242, -1)
        worker = 0
    else:  # a directory of ours, seen as the worker of another uid
        worker = ME + 1
    problem = own_problem(cache, worker)
    assert problem is not None and "is owned by uid" in problem and str(cache) in problem


def test_run_check_and_models_fetch_refuse_a_cache_others_may_write_at_start(
    monkeypatch, tmp_path, capsys
):
    from worker.commands.cli import main
    from worker.commands.localservers import free_port

    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.chdir(tmp_path)  # no .env
    for name in [name for name in os.environ if name.startswith("WORKER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORKER_MODEL__PIPELINES", "moth_binary,panama_moths_2023")
    monkeypatch.setenv("WORKER_MODEL__CACHE_DIR", str(cache))
    # Were it not refused, run would give up on a server that is not there.
    monkeypatch.setenv("WORKER_NATS__URL", f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match="WORKER_MODEL__CACHE_DIR: "):
        load_settings()
    refusal = f"config error: WORKER_MODEL__CACHE_DIR: {cache} is not this worker's own"
    for argv in (["run"], ["check"], ["models", "fetch"]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.startswith(refusal), argv
    assert list(cache.iterdir()) == []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default: made ours
    monkeypatch.delenv("WORKER_MODEL__CACHE_DIR")
    load_settings()
