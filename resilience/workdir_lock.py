"""One run per workdir: process 0 holds `<workdir>/run.lock` while it trains.

The lock is the kernel's advisory lock (flock) on that file, not the file's content: taking it and
holding it are one atomic step, the kernel drops it when its process dies however it dies, so no
stale lock ever needs taking over by guesswork. The file names the holder (host and pid) so that a
refused run can say whom it waited for.
"""

import errno
import fcntl
import json
import os
import socket
from pathlib import Path


class WorkdirLock:
  """Held by process 0 of a run while it trains; two runs in one workdir would lose each other's work."""

  def __init__(self, workdir: str):
    self.path = Path(workdir).resolve() / "run.lock"
    self._fd = None

  def __enter__(self):
    self.path.parent.mkdir(parents=True, exist_ok=True)
    while self._fd is None:
      fd = self._open()
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        raise ValueError(self._in_use(self._holder())) from None
      if not self._is_at_path(fd):  # locked a file its holder unlinked as it left: lock the new one
        os.close(fd)
        continue
      holder = self._holder()
      if holder is not None and holder.get("host") != socket.gethostname():
        # A lock written on another host whose flock we could take: that host's run may still be
        # alive on a filesystem that does not share flocks between hosts, so only a person can tell.
        os.close(fd)
        raise ValueError(self._in_use(holder))
      os.ftruncate(fd, 0)
      os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
      self._fd = fd
    return self

  def _open(self) -> int:
    try:
      # Not following a link: the lock's JSON would truncate whatever file the link points at.
      return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except IsADirectoryError:
      raise ValueError(f"{self.path} is a folder, not a run's lock file; remove it or choose another "
                       "--config.workdir.") from None
    except OSError as error:
      if error.errno == errno.ELOOP:
        raise ValueError(f"{self.path} is a symbolic link to {os.readlink(self.path)}, not a run's lock file; "
                         "remove the link or choose another --config.workdir.") from None
      raise ValueError(f"{self.path} cannot be opened as the run's lock file ({error.strerror}); choose "
                       "another --config.workdir.") from None

  def _is_at_path(self, fd: int) -> bool:
    try:
      return os.stat(self.path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
      return False

  def _in_use(self, holder: dict | None) -> str:
    who = (f"the run of pid {holder.get('pid')} on {holder.get('host')}" if holder else
           "another run (still starting: its lock names no holder yet)")
    return (f"{self.path.parent} is in use by {who} ({self.path}); wait for it to end or choose another "
            "--config.workdir (delete the lock only if that run is gone).")

  def _holder(self) -> dict | None:
    """Who the lock file names, or None when it names no one (being written, or not meshlm's)."""
    try:
      holder = json.loads(self.path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
      return None
    return holder if isinstance(holder, dict) else None

  def __exit__(self, *exc_info):
    if self._fd is not None:
      # Unlinked while still held: a starter that opened this file meanwhile finds it gone from the
      # path once it gets the flock, and locks a new one (`_is_at_path`).
      self.path.unlink(missing_ok=True)
      os.close(self._fd)
      self._fd = None
