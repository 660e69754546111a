"""Plots like the BD-LoRA paper's Fig. 5 and a markdown table from collected sweep results; a table of one-GPU
side-by-side engine runs (``bench/serve/auto_proxy_rr.sh``: ``rr_*.json``).

    python -m bench.serve.report RESULTS_DIR [RESULTS_DIR ...] --plots PLOT_DIR --markdown TABLE.md
    python -m bench.serve.report --rr RR_DIR [RR_DIR ...]

One figure per setting (TP, adapter mode, BS, IT, OT) with four panels against trainable parameters: throughput
(output tokens/s of a request, mean over requests: the paper's metric), E2E latency, decoding latency (TPOT =
(E2E - TTFT)/(OT - 1)) and prefill latency (TTFT); one line per method (LoRA/NFS green, S-LoRA blue, BD-LoRA
orange, as in the paper), the no-LoRA server as a dashed line; error bars are 95% confidence intervals of the mean
over requests.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

from .sweep import collect_summaries
from .trace import kernel_category

COLORS = {"lora": "tab:green", "slora": "tab:blue", "bd": "tab:orange", "base": "black"}
NAMES = {"lora": "LoRA (NFS, vLLM default)", "slora": "S-LoRA (fully sharded)", "bd": "BD-LoRA", "base": "no LoRA"}
PANELS = [  # (summary key prefix, title, unit scale, unit)
    ("results_request_output_throughput_token_per_s", "Throughput (tok/s per request) ↑", 1.0, "tok/s"),
    ("results_end_to_end_latency_s", "E2E latency ↓", 1.0, "s"),
    ("results_tpot_s", "Decoding latency (TPOT) ↓", 1e3, "ms"),
    ("results_ttft_s", "Prefill latency (TTFT) ↓", 1e3, "ms"),
]


def setting_key(s: dict) -> tuple:
    return (s.get("model_shape") or "?", int(s.get("tp") or 0), s.get("num_concurrent_requests"),
            s.get("mean_input_tokens"), s.get("mean_output_tokens"))


def ci95(s: dict, prefix: str) -> float:
    n = s.get("results_num_completed_requests") or 0
    sd = s.get(f"{prefix}_stddev")
    if not n or sd is None or (isinstance(sd, float) and math.isnan(sd)):
        return 0.0
    return 1.96 * float(sd) / math.sqrt(n)


def usable(summaries: Iterable[dict]) -> list[dict]:
    return [s for s in summaries if s.get("results_num_completed_requests")]


def plot(summaries: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in usable(summaries):
        groups[setting_key(s)].append(s)
    paths = []
    for key, items in sorted(groups.items(), key=lambda kv: str(kv[0])):
        shape, tp, bs, it, ot = key
        modes = sorted({s.get("adapter_mode") for s in items if s.get("method") != "base"}) or ["single"]
        for mode in modes:
            fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
            for ax, (prefix, title, scale, unit) in zip(axes, PANELS):
                for method in ("lora", "slora", "bd"):
                    pts = sorted((s for s in items if s.get("method") == method and s.get("adapter_mode") == mode),
                                 key=lambda s: s.get("trainable_params") or 0)
                    if not pts:
                        continue
                    x = [s["trainable_params"] / 1e6 for s in pts]
                    y = [s[f"{prefix}_mean"] * scale for s in pts]
                    e = [ci95(s, prefix) * scale for s in pts]
                    ax.errorbar(x, y, yerr=e, marker="o", capsize=3, color=COLORS[method], label=NAMES[method])
                    for xi, yi, s in zip(x, y, pts):
                        ax.annotate(f"r{s.get('rank')}", (xi, yi), textcoords="offset points", xytext=(3, 4),
                                    fontsize=7, color=COLORS[method])
                base = [s for s in items if s.get("method") == "base"]
                if base:
                    ax.axhline(base[0][f"{prefix}_mean"] * scale, color="black", ls="--", lw=1, label=NAMES["base"])
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
                ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.set_xlabel("trainable parameters (M)")
                ax.set_ylabel(unit)
                ax.set_title(title, fontsize=10)
                ax.grid(alpha=0.3)
            axes[0].legend(fontsize=8)
            dev = items[0].get("device", "")
            fig.suptitle(f"{shape}, TP={tp}, BS={bs}, IT={it}, OT={ot}, adapters: {mode} — {dev}", fontsize=11)
            fig.tight_layout()
            p = out_dir / f"serve_{shape}_tp{tp}_bs{bs}_it{it}_ot{ot}_{mode}.png"
            fig.savefig(p, dpi=110)
            plt.close(fig)
            paths.append(p)
    return paths


def _fmt(v: Optional[float], scale: float = 1.0, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v * scale:.{nd}f}"


def markdown_table(summaries: list[dict]) -> str:
    """One table per setting: method, ranks, parameters, TTFT/TPOT/E2E/throughput, TPOT over no-LoRA, BD speed-ups."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in usable(summaries):
        groups[setting_key(s)].append(s)
    lines = []
    order = {"base": 0, "lora": 1, "slora": 2, "bd": 3}
    for key, items in sorted(groups.items(), key=lambda kv: str(kv[0])):
        shape, tp, bs, it, ot = key
        dev = items[0].get("device", "?")
        ver = items[0].get("vllm_version", "?")
        n = items[0].get("results_num_requests_started")
        lines.append(f"\n#### {shape}, TP={tp}, BS={bs}, IT={it}, OT={ot} ({dev}, vLLM {ver}, {n} requests)\n")
        lines.append("| method | adapters | std rank | rank | trainable params | TTFT ms | TPOT ms | E2E ms | "
                     "tok/s/request | tok/s total | TPOT vs no LoRA | BD TPOT speed-up | BD E2E speed-up | errors |")
        lines.append("|---" * 14 + "|")
        base = next((s for s in items if s.get("method") == "base"), None)
        base_tpot = base["results_tpot_s_mean"] if base else None
        bd_by = {(s.get("std_rank"), s.get("adapter_mode")): s for s in items if s.get("method") == "bd"}
        for s in sorted(items, key=lambda s: (order.get(s.get("method"), 9), s.get("adapter_mode") or "",
                                              s.get("std_rank") or 0)):
            tpot = s["results_tpot_s_mean"]
            rel = f"{(tpot / base_tpot - 1) * 100:+.0f}%" if base_tpot and s.get("method") != "base" else "–"
            bd = bd_by.get((s.get("std_rank"), s.get("adapter_mode")))
            vs_bd = bd is not None and s.get("method") in ("lora", "slora")
            speed = f"{tpot / bd['results_tpot_s_mean']:.2f}x" if vs_bd else "–"
            e2e = s["results_end_to_end_latency_s_mean"]
            e2e_speed = f"{e2e / bd['results_end_to_end_latency_s_mean']:.2f}x" if vs_bd else "–"
            tp_params = s.get("trainable_params") or 0
            lines.append(
                f"| {NAMES.get(s.get('method'), s.get('method'))} | {s.get('adapter_mode')} | "
                f"{s.get('std_rank') or '–'} | {s.get('rank') or '–'} | {tp_params / 1e6:.1f}M | "
                f"{_fmt(s['results_ttft_s_mean'], 1e3)} | {_fmt(tpot, 1e3, 2)} | "
                f"{_fmt(e2e, 1e3)} | "
                f"{_fmt(s['results_request_output_throughput_token_per_s_mean'])} | "
                f"{_fmt(s['results_mean_output_throughput_token_per_s'])} | {rel} | {speed} | {e2e_speed} | "
                f"{s.get('results_number_errors')} |")
    lines.append("\nTPOT = (E2E - TTFT)/(OT - 1), the paper's decoding latency; tok/s/request = OT / E2E averaged over "
                 "requests (the paper's throughput); tok/s total = all output tokens / wall time of the run. "
                 "\"BD TPOT / E2E speed-up\" = this method's TPOT / E2E over BD-LoRA's at the same standard rank "
                 "(BD at the parameter-matched rank).")
    return "\n".join(lines) + "\n"


def trace_table(dirs: Iterable[Path]) -> str:
    """Markdown table of the ``trace_summary.json`` files under ``dirs`` (sweeps with ``profile:``; later
    directories win on a server id): GPU time per decode step by kernel category and the LoRA kernels' calls."""
    found: dict = {}
    for d in dirs:
        for p in sorted(Path(d).glob("*/trace_summary.json")):
            found[p.parent.name] = json.loads(p.read_text())
    if not found:
        return ""
    cats = ("lora", "gemm", "attention", "allreduce", "other")
    lines = ["#### GPU time per decode step (us; rank-0 worker, one profiled request, `bench/serve/trace.py`)\n",
             "| server | " + " | ".join(cats) + " | busy | period | LoRA kernels (calls per step x us per call) |",
             "|---" * (len(cats) + 4) + "|"]
    for sid, t in found.items():
        ps = t.get("per_step_us", {})
        lora = [k for k in t.get("top_kernels", []) if kernel_category(k["name"]) == "lora"]
        calls = ", ".join(f"{k['name']} {k['calls_per_step']:g} x "
                          f"{k['us_per_step'] / max(k['calls_per_step'], 1e-9):.1f}" for k in lora) or "–"
        lines.append(f"| {sid} | " + " | ".join(_fmt(ps.get(c), 1.0, 0) for c in cats)
                     + f" | {_fmt(t.get('busy_us'), 1.0, 0)} | {_fmt(t.get('period_us'), 1.0, 0)} | {calls} |")
    lines.append("\nThe profiler slows each step (~1 ms on an 8B model at TP=4): compare kernel columns, not periods; "
                 "the all-reduce column includes waiting for the other ranks.")
    return "\n".join(lines) + "\n"


QUIET_WINDOW = 128  # steps per window of ``quiet_ms``


def quiet_ms(times: list, window: int = QUIET_WINDOW) -> Optional[float]:
    """The least median over windows of ``window`` consecutive engine steps (``step_times_ms``; windows start every
    ``window`` steps): the engine's step in its quietest stretch of the round. On these hosts an engine's steps hold one
    level for seconds and then another (bench/results/serve/tpot_2026-11-28), so a round's median can mix levels that
    the quietest window does not. None when the round kept fewer than ``window`` steps."""
    medians = [statistics.median(times[i:i + window]) for i in range(0, len(times) - window + 1, window)]
    return min(medians) if medians else None


def rr_table(dirs: Iterable[Path], base: str = "base") -> str:
    """Markdown table of ``auto_proxy.py`` results (``rr_<shape>_<engine>.json``) in each of ``dirs`` (one run of
    engines side by side each): per run, shape and engine, decode ms per step at each batch ("B=", two generates
    subtracted; "step B=": the median engine step in steady decode; "quiet B=": ``quiet_ms`` of the round's steps,
    where the result keeps them) and TTFT, as the minimum
    (median) over rounds and, beside it, the change of each against the ``base`` engine of the same run and shape,
    and the paired change: the median over rounds of engine / base - 1 within the same round (the engines measure in
    turns, so a round's values are minutes apart and share the machine's state; this cancels drift between rounds
    that the minimum and median of each engine alone keep)."""
    lines = []
    for d in dirs:
        runs: dict = defaultdict(dict)  # shape -> engine -> metric -> {round: value}
        for p in sorted(Path(d).glob("rr_*.json")):
            r = json.loads(p.read_text())
            eng = runs[r["shape"]].setdefault(r["engine"], defaultdict(dict))
            for i, row in enumerate(r.get("rows", [])):
                for metric, label in (("decode_ms_per_step", "B="), ("step_ms", "step B="), ("ttft_ms", "TTFT B=")):
                    value = row.get(metric)
                    if value is not None:  # None: auto_proxy flagged that round's difference as noise
                        eng[f"{label}{row['batch']}"][row.get("round", i)] = value
            for steps in r.get("step_times_ms", []):
                value = quiet_ms(steps["times"])
                if value is not None:
                    eng[f"quiet B={steps['batch']}"][steps["round"]] = round(value, 3)
        for shape, engines in runs.items():
            keys = sorted({k for e in engines.values() for k in e},
                          key=lambda k: ("TTFT" in k, "quiet" in k, "step" in k, int(k.split("=")[1])))
            n = max(len(v) for e in engines.values() for v in e.values())
            lines += [f"\n`{d}`, {shape}: min (median) over {n} rounds; [min, median; paired median] vs `{base}`\n",
                      "| engine | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
            ref = engines.get(base, {})
            for name, m in engines.items():
                cells = []
                for k in keys:
                    by_round = m.get(k, {})
                    if not by_round:
                        cells.append("–")
                        continue
                    v = sorted(by_round.values())
                    med = statistics.median(v)
                    cell = f"{v[0]:.3f} ({med:.3f})"
                    b = ref.get(k, {})
                    if b and name != base:
                        bv = list(b.values())
                        cell += f" [{100 * (v[0] / min(bv) - 1):+.1f}%, {100 * (med / statistics.median(bv) - 1):+.1f}%"
                        paired = [by_round[i] / b[i] - 1 for i in by_round if i in b]
                        cell += f"; {100 * statistics.median(paired):+.1f}%]" if paired else "]"
                    cells.append(cell)
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n") + "\n" if lines else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", help="sweep --out directories (later ones win on duplicates)")
    p.add_argument("--plots", help="directory for PNG figures")
    p.add_argument("--markdown", help="write the tables here (default: print)")
    p.add_argument("--rr", action="store_true", help="the dirs hold auto_proxy_rr.sh runs (rr_*.json): one table each")
    a = p.parse_args(argv)
    if a.rr:
        md = rr_table([Path(d) for d in a.dirs])
        if not md:
            p.error(f"no rr_*.json under {a.dirs}")
        print(md)
        return 0
    summaries = collect_summaries([Path(d) for d in a.dirs])
    if not summaries:
        p.error(f"no *_summary.json under {a.dirs}")
    if a.plots:
        for path in plot(summaries, Path(a.plots)):
            print(path)
    md = markdown_table(summaries)
    traces = trace_table([Path(d) for d in a.dirs])
    if traces:
        md += "\n" + traces
    if a.markdown:
        Path(a.markdown).write_text(md)
        print(a.markdown)
    else:
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
