"""One run per workdir: a lock file naming the holder's host and pid, stale once that process is gone."""

import json
import os
import socket
from pathlib import Path


class WorkdirLock:
  """Held by process 0 of a run while it trains; two runs in one workdir would lose each other's work."""

  def __init__(self, workdir: str):
    self.path = Path(workdir).resolve() / "run.lock"
    self._held = False

  def __enter__(self):
    self.path.parent.mkdir(parents=True, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    while not self._held:
      try:
        with open(self.path, "x") as f:  # exclusive create: of two racing runs, one wins
          json.dump(me, f)
        self._held = True
      except FileExistsError:
        holder = self._holder()
        if holder is not None and (holder.get("host") != me["host"] or _alive(holder.get("pid"))):
          raise ValueError(f"{self.path.parent} is in use by the run of pid {holder.get('pid')} on "
                           f"{holder.get('host')} ({self.path}); wait for it to end or choose another "
                           "--config.workdir (delete the lock only if that run is gone).") from None
        self.path.unlink(missing_ok=True)  # stale (its process is gone) or torn: take it over
    return self

  def _holder(self) -> dict | None:
    try:
      return json.loads(self.path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
      return None

  def __exit__(self, *exc_info):
    if self._held:
      self.path.unlink(missing_ok=True)
      self._held = False


def _alive(pid) -> bool:
  if not isinstance(pid, int):
    return False
  try:
    os.kill(pid, 0)  # signal 0: only asks whether the process exists
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # it exists, under another user
  return True
