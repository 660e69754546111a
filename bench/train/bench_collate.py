"""Host time of one batch's collation: `bdlora train`'s padded and packed collators and the engine's micro-batch
builder, on random token ids (CPU only; best of 5 repeats of 50 calls each).

    python bench/train/bench_collate.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from types import SimpleNamespace


def best_ms(fn, calls: int = 50, repeats: int = 5) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return round(best / calls * 1e3, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the timings here as JSON")
    a = ap.parse_args(argv)
    from bdlora.train.data import collate, pack_rows
    from bdlora.train.engine.packing import Item, MIN_ROW_TOKENS, build_microbatch

    rng = random.Random(0)

    def ex(n):
        return {"input_ids": [rng.randrange(32000) for _ in range(n)], "labels": [rng.randrange(32000) for _ in range(n)]}

    long4 = [ex(2048) for _ in range(4)]
    short32 = [ex(rng.randint(30, 250)) for _ in range(32)]
    samples = {"4x2048": [SimpleNamespace(input_ids=e["input_ids"], loss_mask=[True] * 2048) for e in long4],
               "32x30-250": [SimpleNamespace(input_ids=e["input_ids"], loss_mask=[True] * len(e["input_ids"]))
                             for e in short32]}
    res = {"trainer collate 4x2048": best_ms(lambda: collate(long4, 0)),
           "trainer collate 32x30-250": best_ms(lambda: collate(short32, 0)),
           "trainer packing 32x30-250": best_ms(lambda: pack_rows(short32, 0, MIN_ROW_TOKENS))}
    for name, ss in samples.items():
        items = [Item(0, i, len(s.input_ids)) for i, s in enumerate(ss)]
        res[f"engine micro-batch {name}"] = best_ms(lambda: build_microbatch(items, lambda j: ss, 0, 64))
    out = {"ms_per_batch": res, "machine": platform.processor() or platform.machine(), "python": platform.python_version()}
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
