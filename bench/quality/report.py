"""Confidence-interval table and a Fig. 4-style plot from ``bench.quality.run`` results.

    python -m bench.quality.report OUT [OUT2|FILE.jsonl ...] [--plot FIG.png] [--markdown TABLE.md] [--merge-to F]

Reads every ``results.jsonl`` / ``results.*.jsonl`` under the given folders (or the given files), one row per run_id
(duplicates from shards, resumed calls or copied files count once; :mod:`bench.quality.results`). ``--merge-to``
writes those rows as one deduplicated results file (e.g. for ``bench/results/quality/results.jsonl``).

A task trained for several step counts (``--max-steps``) is reported as one task per count (``boolq-t1200``, each
with the task's base row): adapters trained for 150 and 1200 steps are different experiments. Groups runs by
(task, method, N, rank) over seeds: mean and a 95% confidence interval of the mean (Student t,
n-1 degrees of freedom), with the untrained base model's row and (BoolQ) the eval set's majority rate. Then the
paired comparison: each BD run against the LoRA run of the same seed (same data order) at the matched size (the LoRA
group with the closest trainable-parameter count): the mean difference BD - LoRA with its 95% CI. The CI's
half-width is the smallest difference the experiment resolves: a true gap larger than it would have shown as a CI
that excludes zero. The plot shows eval perplexity (and accuracy) against trainable parameters, LoRA and BD-LoRA
as separate lines with CI error bars, as the BD-LoRA paper's Fig. 4.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

from bdlora.train.tasks import write_jsonl

from .metrics import SCORES
from .results import read_rows

# two-sided 95% Student t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    if df <= 0:
        return float("nan")
    for k in sorted(_T95):
        if df <= k:
            return _T95[k]
    return 1.96


def mean_ci(vals: list[float]) -> tuple[float, float]:
    vals = [v for v in vals if v is not None]
    if not vals:
        return float("nan"), float("nan")
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, float("nan")
    return m, t95(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))


SCORE_NAMES = {"accuracy": "accuracy", "rougeL": "ROUGE-L F1"}


def load_rows(sources) -> list[dict]:
    """One row per run_id from results folders or files (:func:`bench.quality.results.read_rows`)."""
    return read_rows(sources)


def split_by_steps(rows: list[dict]) -> list[dict]:
    """Rows of a task trained for more than one step count, renamed ``<task>-t<steps>`` (the run ids' suffix); the
    task's base row (no training) is repeated under each name. Tasks trained for one step count keep their name."""
    counts: dict[str, set] = defaultdict(set)
    for r in rows:
        if r["method"] != "base":
            counts[r["task"]].add(r["steps"])
    out = []
    for r in rows:
        steps = sorted(counts.get(r["task"], ()))
        if len(steps) <= 1:
            out.append(r)
        elif r["method"] == "base":
            out += [{**r, "task": f"{r['task']}-t{n}"} for n in steps]
        else:
            out.append({**r, "task": f"{r['task']}-t{r['steps']}"})
    return out


#: (LoRA method, BD method) pairs compared at matched size: on the bf16 base, and both on a 4-bit base
FAMILIES = (("lora", "bd"), ("qlora", "qbd"))


def label(method: str, nblocks) -> str:
    if method == "base":
        return "base model (no adapter)"
    name = "LoRA (rsLoRA)" if method in ("lora", "qlora") else f"BD-LoRA N={nblocks} (rsLoRA)"
    return f"{name}, 4-bit base" if method.startswith("q") else name


def metric_of(rows: list[dict]) -> tuple[str, int]:
    """The task's headline metric and its sign (+1: higher is better): accuracy or ROUGE-L where scored, else eval
    loss."""
    for key in SCORES:
        if any(key in r for r in rows):
            return key, 1
    return "eval_loss", -1


def paired(rows: list[dict]) -> list[dict]:
    """BD - LoRA per (task, base, N, BD rank), paired by seed against the LoRA rank of the closest parameter count:
    BD-LoRA against LoRA on the bf16 base, and on the 4-bit base (``base`` "4-bit")."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        rs = [r for r in rows if r["task"] == task]
        key, _ = metric_of(rs)
        for lora_m, bd_m in FAMILIES:
            out += _paired_family(task, key, rs, lora_m, bd_m)
    return out


def _paired_family(task: str, key: str, rs: list[dict], lora_m: str, bd_m: str) -> list[dict]:
    out = []
    lora = defaultdict(dict)
    for r in rs:
        if r["method"] == lora_m:
            lora[r["rank"]][r["seed"]] = r
    bd = defaultdict(dict)
    for r in rs:
        if r["method"] == bd_m:
            bd[(r["nblocks"], r["rank"])][r["seed"]] = r
    if not lora:
        return out
    for (n, rank), by_seed in sorted(bd.items()):
        params = next(iter(by_seed.values()))["trainable_params"]
        lr = min(lora, key=lambda k: abs(next(iter(lora[k].values()))["trainable_params"] - params))
        diffs = [by_seed[s][key] - lora[lr][s][key] for s in sorted(by_seed)
                 if s in lora[lr] and by_seed[s].get(key) is not None and lora[lr][s].get(key) is not None]
        if diffs:
            m, ci = mean_ci(diffs)
            out.append({"task": task, "metric": key, "base": "4-bit" if bd_m == "qbd" else "bf16", "nblocks": n,
                        "bd_rank": rank, "lora_rank": lr, "pairs": len(diffs), "diff": m, "diff_ci": ci})
    return out


def detectable(pairs: list[dict]) -> list[str]:
    """Per task, what the paired comparison rules out: the range every BD - LoRA difference's 95% interval lies in,
    the widest half-width (about the smallest gap the experiment resolves at one size) and the intervals that
    exclude zero."""
    out = []
    for task, base in sorted({(d["task"], d.get("base", "bf16")) for d in pairs}):
        ds = [d for d in pairs if (d["task"], d.get("base", "bf16")) == (task, base) and not math.isnan(d["diff_ci"])]
        if base != "bf16":
            task = f"{task} on the {base} base"
        if not ds:
            out.append(f"{task}: one seed per pair, no interval: nothing is ruled out yet")
            continue
        lo = min(d["diff"] - d["diff_ci"] for d in ds)
        hi = max(d["diff"] + d["diff_ci"] for d in ds)
        excl = [d for d in ds if abs(d["diff"]) > d["diff_ci"]]
        found = ("; intervals excluding zero: " + ", ".join(f"N={d['nblocks']} rank {d['bd_rank']} "
                                                           f"({d['diff']:+.4f})" for d in excl)) if excl else ""
        out.append(f"{task} ({ds[0]['metric']}): every BD - LoRA interval lies in [{lo:+.4f}, {hi:+.4f}]; the "
                   f"widest half-width is {max(d['diff_ci'] for d in ds):.4f}: a true gap of about that size at one "
                   f"matched size would likely have given an interval excluding zero{found}")
    return out


def aggregate(rows: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"], r.get("nblocks"), r["rank"])].append(r)
    out = []
    for (task, method, n, rank), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0,
                                                                                 kv[0][3])):
        g = {"task": task, "method": method, "nblocks": n, "rank": rank, "seeds": len(rs),
             "trainable_params": rs[0]["trainable_params"], "steps": rs[0]["steps"], "device": rs[0].get("device")}
        for key in ("eval_loss", "eval_ppl", *SCORES, "train_loss", *(f"bf16_{k}" for k in ("eval_loss", *SCORES))):
            if any(r.get(key) is not None for r in rs):
                g[key], g[key + "_ci"] = mean_ci([r.get(key) for r in rs])
        if rs[0].get("majority_baseline") is not None:
            g["majority_baseline"] = rs[0]["majority_baseline"]
        out.append(g)
    return out


def markdown(groups: list[dict], paired_rows: list[dict] = ()) -> str:
    lines = []
    for task in sorted({g["task"] for g in groups}):
        gs = [g for g in groups if g["task"] == task]
        scores = [k for k in SCORES if any(k in g for g in gs)]
        g0 = next((g for g in gs if g["method"] != "base"), gs[0])
        majority = [g["majority_baseline"] for g in gs if g.get("majority_baseline") is not None]
        chance = f"; majority-class rate {majority[0]:.3f}" if majority and majority[0] > 0 else ""
        lines.append(f"\n#### {task} ({g0['steps']} steps, {g0.get('device')}; mean ± 95% CI over seeds{chance})\n")
        # 4-bit rows are also scored with their adapter on the bf16 base
        on_bf16 = [k for k in ("bf16_eval_loss", *(f"bf16_{k}" for k in scores)) if any(k in g for g in gs)]
        head = ("| method | rank | trainable params | seeds | eval loss | eval perplexity |"
                + "".join(f" {SCORE_NAMES[k]} |" for k in scores)
                + "".join(f" on the bf16 base: {SCORE_NAMES.get(k[5:], 'eval loss')} |" for k in on_bf16))
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for g in sorted(gs, key=lambda g: (g["trainable_params"], g["method"])):
            f = lambda k, nd: (f"{g[k]:.{nd}f} ± {g[k + '_ci']:.{nd}f}" if not math.isnan(g.get(k + "_ci", math.nan))
                               else f"{g[k]:.{nd}f}") if k in g else "–"
            lines.append(f"| {label(g['method'], g['nblocks'])} | {g['rank']} | {g['trainable_params'] / 1e6:.2f}M | "
                         f"{g['seeds']} | {f('eval_loss', 4)} | {f('eval_ppl', 3)} |"
                         + "".join(f" {f(k, 3)} |" for k in scores)
                         + "".join(f" {f(k, 4 if k.endswith('loss') else 3)} |" for k in on_bf16))
    pairs = paired_rows
    if pairs:
        lines += ["\n#### BD-LoRA - LoRA at matched size, paired by seed (mean ± 95% CI; the ± is the smallest gap the "
                  "experiment resolves)\n",
                  "| task | metric | base | N | BD rank | LoRA rank | pairs | BD - LoRA |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in pairs:
            ci = "" if math.isnan(d["diff_ci"]) else f" ± {d['diff_ci']:.4f}"
            lines.append(f"| {d['task']} | {d['metric']} | {d.get('base', 'bf16')} | {d['nblocks']} | {d['bd_rank']} | "
                         f"{d['lora_rank']} | {d['pairs']} | {d['diff']:+.4f}{ci} |")
        lines.append("")
        lines += [f"- {line}" for line in detectable(pairs)]
    return "\n".join(lines) + "\n"


def plot(groups: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = []
    for task in sorted({g["task"] for g in groups}):
        panels.append((task, "eval_ppl", "eval perplexity ↓"))
        for k in SCORES:
            if any(k in g for g in groups if g["task"] == task):
                panels.append((task, k, f"{SCORE_NAMES[k]} ↑"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    colors = {"lora": "tab:green", 2: "tab:red", 3: "tab:orange", 4: "tab:purple", 6: "tab:brown", 8: "tab:pink"}
    for ax, (task, key, title) in zip(axes[0], panels):
        series = defaultdict(list)
        for g in groups:
            if g["task"] == task and key in g:
                series[(g["method"], g["nblocks"])].append(g)
        for (method, n), gs in sorted(series.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            if method == "base":  # no parameters to place it at: a level line
                ax.axhline(gs[0][key], linestyle=":", color="gray", label=label(method, n))
                continue
            gs.sort(key=lambda g: g["trainable_params"])
            x = [g["trainable_params"] / 1e6 for g in gs]
            y = [g[key] for g in gs]
            e = [0 if math.isnan(g[key + "_ci"]) else g[key + "_ci"] for g in gs]
            ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=label(method, n),
                        linestyle="--" if method in ("qlora", "qbd") else "-",
                        color=colors["lora"] if method in ("lora", "qlora") else colors.get(n, None))
        ax.set_xscale("log")
        ys = [g[key] for gs in series.values() for g in gs]
        if key == "eval_ppl" and max(ys) > 20 * min(ys):  # a base row ~1000x the adapters' (recall): log keeps both
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("trainable parameters (M)")
        ax.set_title(f"{task}: {title}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="bench.quality.run --out directories, or results JSONL files")
    ap.add_argument("--plot", help="PNG path")
    ap.add_argument("--markdown", help="write the table here (default: print)")
    ap.add_argument("--merge-to", help="write the deduplicated rows of all inputs to this JSONL file (it may be one of "
                                       "the inputs; nothing may be appending to it meanwhile)")
    a = ap.parse_args(argv)
    rows = load_rows(a.dirs)  # as stored (what --merge-to writes); the tables split a task by its step counts
    if a.merge_to:
        print(f"{write_jsonl(rows, a.merge_to)}: {len(rows)} runs")  # atomic: temp file + rename
        if not rows or not (a.plot or a.markdown):
            return 0
    if not rows:
        ap.error(f"no results rows under {a.dirs}")
    rows = split_by_steps(rows)
    groups = aggregate(rows)
    if a.plot:
        print(plot(groups, Path(a.plot)))
    md = markdown(groups, paired(rows))
    if a.markdown:
        Path(a.markdown).write_text(md)
        print(a.markdown)
    else:
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
