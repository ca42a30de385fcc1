"""File access of a cache directory: which names a manifest may list, reading only regular
files inside the directory with bounded reads, atomic writes, and the builder's lock.

A manifest is data from disk, so nothing it names is trusted: a listed file must have one
of the format's own names (``index.arrow`` or ``parts/rank-NNNNN/part-NNNNNN.arrow``), no
component of its path may be a symbolic link, and it must be a regular file (never a FIFO,
a device or ``/proc``); reads never go past the size the manifest records. A crafted manifest
therefore cannot make the library read or write outside the cache directory, or hang.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from .errors import RefCacheCorruptError, RefCacheLockedError, RefCacheWriteError

INDEX = "index.arrow"
_DATA_NAME = re.compile(r"index\.arrow|parts/rank-[0-9]{5}/part-[0-9]{6}\.arrow")
_PART_NAME = re.compile(r"rank-[0-9]{5}/part-[0-9]{6}\.arrow")
MAX_JSON_BYTES = 64 << 20  # a manifest of a million parts is ~300 MiB; bookkeeping JSON is far smaller
_BLOCK = 1 << 20


def check_data_name(name: object, where: object) -> str:
    """``name`` if it is a data-file name of the format (relative to the cache directory).

    Raises:
        RefCacheCorruptError: anything else (absolute paths, ``..``, other names), naming ``where``.
    """
    if not isinstance(name, str) or not _DATA_NAME.fullmatch(name):
        raise RefCacheCorruptError(where, f"lists file {name!r}, which is not a cache file name (index.arrow or "
                                          "parts/rank-NNNNN/part-NNNNNN.arrow inside the cache directory)")
    return name


def check_part_name(name: object, where: object) -> str:
    """``name`` if it is a part name relative to ``parts/`` (``rank-NNNNN/part-NNNNNN.arrow``).

    Raises:
        RefCacheCorruptError: anything else, naming ``where``.
    """
    if not isinstance(name, str) or not _PART_NAME.fullmatch(name):
        raise RefCacheCorruptError(where, f"names part {name!r}, which is not rank-NNNNN/part-NNNNNN.arrow")
    return name


def open_regular(root: Path, name: str) -> tuple[int, int]:
    """Open ``root / name`` read-only as ``(fd, size)``; the caller closes ``fd``.

    ``name`` must be relative; no component below ``root`` may be a symbolic link, and the
    file must be regular. Opening is non-blocking, so a FIFO planted in the directory is
    refused instead of waited on.

    Raises:
        RefCacheCorruptError: missing, a symbolic link, outside ``root``, not a regular file, or
            unreadable.
    """
    path = Path(root) / name
    if os.path.realpath(path) != os.path.join(os.path.realpath(root), name):
        raise RefCacheCorruptError(path, "is a symbolic link or lies outside the cache directory")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RefCacheCorruptError(path, "no file (missing)") from None
    except OSError as e:
        raise RefCacheCorruptError(path, f"cannot be opened ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RefCacheCorruptError(path, "is not a regular file")
    return fd, st.st_size


def read_bounded(root: Path, name: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole of the regular file ``root / name``, refusing one larger than ``limit`` bytes.

    Raises:
        RefCacheCorruptError: as :func:`open_regular`, or too large.
    """
    fd, size = open_regular(root, name)
    try:
        if size > limit:
            raise RefCacheCorruptError(Path(root) / name, f"is {size} bytes, more than the {limit} a cache "
                                                          "bookkeeping file can have")
        data = os.pread(fd, size, 0)
    except OSError as e:
        raise RefCacheCorruptError(Path(root) / name, f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    return data


def digest_fd(fd: int, nbytes: int) -> str:
    """blake2b-128 of the first ``nbytes`` bytes of ``fd`` (positioned reads in 1 MiB blocks,
    through the page cache, not this process's RSS); a short file hashes what it has."""
    h = hashlib.blake2b(digest_size=16)
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    at = 0
    while at < nbytes:
        n = os.preadv(fd, [view[:min(_BLOCK, nbytes - at)]], at)
        if n == 0:
            break
        h.update(view[:n])
        at += n
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """blake2b-128 of a whole file (one the library wrote itself)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return digest_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def buffer_digest(data: bytes | memoryview | pa.Buffer) -> str:
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()


# --- writing -----------------------------------------------------------------------------

def make_dir(path: Path) -> None:
    """``mkdir -p``.

    Raises:
        RefCacheWriteError: the directory cannot be created (read-only file system, permissions).
    """
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RefCacheWriteError(path, e) from e


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _create_temporary(directory: Path, name: str) -> tuple[int, Path]:
    """A new file ``.<name>.<random>.tmp`` in ``directory``, opened for writing.

    Created with mode ``0o666``, so the kernel applies the caller's umask (and a default ACL)
    as it does for any new file: a cache built under ``umask 022`` is readable by others on a
    shared cluster (``tempfile.mkstemp`` would force ``0o600`` whatever the umask).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        tmp = Path(directory) / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def atomic_write(path: Path, data: bytes | memoryview | pa.Buffer) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory + fsync + rename,
    so ``path`` holds either its old content or all of ``data``. The file's mode follows the
    umask (``0o666 & ~umask``).

    Raises:
        RefCacheWriteError: any ``OSError`` on the way (the temporary file is removed).
    """
    path = Path(path)
    make_dir(path.parent)
    tmp = None
    try:
        fd, tmp = _create_temporary(path.parent, path.name)
        try:
            _write_all(fd, memoryview(data).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise RefCacheWriteError(path, e) from e
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def check_real_dirs(root: Path, names: tuple[str, ...]) -> None:
    """Refuse a planted link before a build touches anything: each of ``root / names[i]`` that
    exists must be a real directory, not a symbolic link (to a directory elsewhere, whose files a
    build would otherwise delete and overwrite) nor anything else. Readers refuse the same links.

    Raises:
        RefCacheCorruptError: naming the first one that is a link or not a directory.
    """
    for name in names:
        path = Path(root) / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise RefCacheCorruptError(path, f"cannot be inspected ({e.strerror or e})") from None
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            what = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
            raise RefCacheCorruptError(path, f"{what}; a build writes only into real directories of the cache",
                                       f"Delete {path} (nothing was written through it) and rerun the build")


def remove_stale_temporaries(directory: Path) -> None:
    """Delete ``.*.tmp`` files an interrupted writer left behind (only this library's)."""
    for p in Path(directory).glob(".*.tmp"):
        if p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive_lock(directory: Path, name: str = "build.lock") -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``directory / name`` (created, recording our pid).

    The kernel drops the lock when the holder exits, killed or not, so a crashed builder never
    leaves a stale lock. The file itself stays (removing it would race with a waiting builder).

    Raises:
        RefCacheLockedError: another process (or another open in this one) holds it.
        RefCacheWriteError: the lock file cannot be created.
    """
    make_dir(directory)
    path = Path(directory) / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise RefCacheWriteError(path, e) from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise RefCacheLockedError(path, int(held) if held.isdigit() else None) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            raise RefCacheWriteError(path, e) from e
        yield
    finally:
        os.close(fd)  # releases the lock
