"""flashcheck/compile_share.py: a kernel another process is compiling is waited for and loaded, not compiled again."""
import os
import threading
import time

import pytest

pytest.importorskip("triton")

from flashcheck import compile_share  # noqa: E402

KEY = "AAAATESTKERNELKEY"
META = "kernel.json"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_share, "POLL", 0.01)
    return tmp_path


def _store(manager):
    """What Triton's compile does after a miss: the files, then the group that names them."""
    path = manager.put(b"{}", META)
    manager.put_group(META, {META: path})


def _looker(found):
    def look():
        found.append(compile_share.SharedCompiles(KEY).get_group(META))
    return threading.Thread(target=look)


def test_a_miss_waits_for_the_compile_in_flight_and_loads_its_result(cache):
    first = compile_share.SharedCompiles(KEY)
    assert first.get_group(META) is None, "expected a miss on an empty cache"
    found = []
    waiter = _looker(found)
    waiter.start()
    time.sleep(0.3)
    assert not found, f"expected the second look to wait while the first compiles, got {found}"
    _store(first)
    waiter.join(5)
    assert found and found[0] is not None and META in found[0], (
        f"expected the second look to load the first compile's result, got {found}")


def test_a_compile_that_fails_lets_the_next_process_compile(cache):
    first = compile_share.SharedCompiles(KEY)
    assert first.get_group(META) is None
    found = []
    waiter = _looker(found)
    waiter.start()
    time.sleep(0.2)
    del first  # the compile raised: Triton drops the manager without storing anything
    waiter.join(5)
    assert found == [None], f"expected the waiter to get the lock and a miss (it compiles), got {found}"


def test_a_waiter_compiles_itself_after_the_wait(cache, monkeypatch):
    monkeypatch.setattr(compile_share, "WAIT", 0.2)
    first = compile_share.SharedCompiles(KEY)
    assert first.get_group(META) is None
    started = time.monotonic()
    second = compile_share.SharedCompiles(KEY).get_group(META)
    assert second is None and time.monotonic() - started < 3, "expected a miss after WAIT seconds, not a hang"
    first._release()


@pytest.mark.parametrize("env, want", [
    ({}, "flashcheck.compile_share:SharedCompiles"),
    ({"TRITON_CACHE_MANAGER": "mine:Manager"}, "mine:Manager"),  # the run's own manager stays
    ({"TRITON_INTERPRET": "1"}, None)])  # the interpreter compiles nothing
def test_the_plugin_names_the_shared_cache_manager_only_where_it_applies(monkeypatch, env, want):
    from flashcheck import plugin

    for name in ("TRITON_CACHE_MANAGER", "TRITON_INTERPRET"):
        monkeypatch.setenv(name, "")  # recorded, so that the test's own setting is undone after it
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plugin._share_compiles()
    got = os.environ.get("TRITON_CACHE_MANAGER")
    assert got == want, f"expected TRITON_CACHE_MANAGER={want!r} with {env}, got {got!r}"


def test_a_file_system_without_locks_compiles_as_triton_would(cache, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert compile_share.SharedCompiles(KEY).get_group(META) is None, "expected a plain miss where flock fails"
