"""kill -9 of a child process at a chosen moment: the common step of the resume-after-a-crash tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable


def sigkill_when(proc: subprocess.Popen, moment: Callable[[], bool], timeout_s: float, poll_s: float = 0.002,
                 group: bool = False) -> bool:
    """Polls ``moment()`` while ``proc`` runs and SIGKILLs it (with ``group``, its whole process group: a launcher's
    workers too; start it with ``start_new_session=True``) as soon as it holds, then waits for it to be gone.
    ``moment`` may race the child's renames (FileNotFoundError counts as not yet). Returns whether it was killed
    (False: the process ended, or ``timeout_s`` passed, before the moment came)."""
    deadline, killed = time.time() + timeout_s, False
    while time.time() < deadline and proc.poll() is None:
        try:
            due = moment()
        except FileNotFoundError:
            due = False
        if due:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(poll_s)
    proc.wait(timeout=60)
    return killed
