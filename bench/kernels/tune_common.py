"""What the tile-sweep scripts (tune_dropout.py, tune_dsdb.py) share: ranking a sweep's configs and writing it."""
import json
import os


def summarize(configs: list[dict], tol: float, top: int) -> tuple[list, int, int]:
    """(the ``top`` fastest configs whose error is below ``tol`` as (us, tiles) pairs, how many were wrong, how many
    failed to compile or run) of sweep rows dict(tiles..., ms=, err=) or dict(tiles..., error=)."""
    ok = sorted([c for c in configs if "ms" in c and c["err"] < tol], key=lambda c: c["ms"])
    best = [(round(c["ms"] * 1000, 1), {k: v for k, v in c.items() if k not in ("ms", "err")}) for c in ok[:top]]
    wrong = sum("ms" in c and c["err"] >= tol for c in configs)
    return best, wrong, sum("error" in c for c in configs)


def write_out(name: str, result) -> None:
    """The sweep as JSON to $OUT/name (./name without $OUT)."""
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(result, f, indent=1)


def run_on_gpu(main, name: str) -> None:
    """Run a sweep's ``main`` where there is a CUDA GPU; elsewhere say so and exit 0."""
    import sys

    import torch

    if not torch.cuda.is_available():
        print(f"{name}: no CUDA GPU here")
        sys.exit(0)
    main()
