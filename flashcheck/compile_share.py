"""Each Triton kernel compiled once across the lane's processes, not once per process at the same time.

xdist's workers draw their shapes from the same buckets (strategies/buckets.py) and start together,
so on a cold cache several of them meet the same kernel at once and all compile it: Triton's file
cache only serves a process that looks after another has stored the result. In the speed bench's
first night on an H200, the two processes of an arm compiled 50 of their 78 autotuned kernels both
(31 of 114 compile-seconds), and 18 of triton-fused's.

``SharedCompiles`` is Triton's file cache with one change: a miss takes an exclusive lock on the
kernel's cache folder and looks again under it, so a process that meets a kernel another is compiling
waits for it and loads the result. The compiling process releases the lock when it stores the result
(``put_group``), or when its compile fails and the manager is dropped; the OS releases it if the
process dies; and a waiter that has waited WAIT seconds compiles the kernel itself. The plugin names it
in TRITON_CACHE_MANAGER (plugin._share_compiles) unless the run names a cache manager of its own.
"""
from __future__ import annotations

import os
import time

from triton.runtime.cache import FileCacheManager

WAIT = 300.0  # seconds; a compile takes at most about a minute (IEEE float32 tiles, docs/gpu-lane.md)
POLL = 0.05


class SharedCompiles(FileCacheManager):
    """Triton's FileCacheManager, whose misses wait for the same compile in flight in another process."""

    _held: int | None = None

    def get_group(self, filename):
        group = super().get_group(filename)
        if group is not None or not getattr(self, "cache_dir", None):
            return group
        import fcntl

        try:
            fd = os.open(os.path.join(self.cache_dir, "flashcheck-compiling.lock"), os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:  # a cache folder that takes no lock file: Triton's own behaviour
            return None
        deadline = time.monotonic() + WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process (or thread) compiles this kernel now
                if time.monotonic() > deadline:
                    os.close(fd)
                    return None  # compile it here too
                time.sleep(POLL)
            except OSError:  # no locks on this file system (some NFS): Triton's own behaviour
                os.close(fd)
                return None
        group = super().get_group(filename)
        if group is not None:  # the other compile stored it
            os.close(fd)
            return group
        self._held = fd  # this process compiles it: held until put_group, or until the manager goes
        return None

    def put_group(self, filename, group):
        try:
            return super().put_group(filename, group)
        finally:
            self._release()

    def _release(self):
        fd, self._held = self._held, None
        if fd is not None:
            try:
                os.close(fd)  # closing the descriptor drops its lock
            except OSError:
                pass

    def __del__(self):
        self._release()

