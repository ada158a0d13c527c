#!/usr/bin/python3
"""Draws benchmark results as PNG plots beside them (issue 9 item 10, issue 31 item 5).

For every directory given, the results in it become one figure,
<dir>/bench_plot.png:
  - CSVs: moe_ep_bench output (e.g. ep_bench.csv or bench_blocking.csv) and
    the PyTorch baseline torch.csv from bench/baseline_torch.py;
  - JSON files of `moe-ep bench --json` (the benchmark any machine, a CPU one
    too, can run), one run per object, several objects per file allowed
    (`moe-ep bench --json >> sweep.json`): each run is one point at its
    tokens_per_rank, latency the slowest rank's p50 (a step ends with its
    slowest rank), GB/s the slowest rank's (the minimum over ranks); one
    line per backend. A JSON file without "ranks" is not bench output and
    is skipped with a note. The figure:

  columns  one per (hidden, top_k) of the rows (EP size in the title)
  row 1    dispatch and combine p50 latency (us) against tokens per rank
  row 2    dispatch and combine logical GB/s against tokens per rank

one line per (source, operation, routing): moe-ep (per CSV and `check`
column value when there is one) against the baseline, uniform routing solid
and skewed dashed; both axes logarithmic.

A directory holding floor_bench.csv and onesided_bench.csv (one GPU call of
moe_ep_floor_bench and moe_ep_onesided_bench; bench/floor_table.py) gets
<dir>/floor_plot.png instead for those two (issue 32 item 3): one panel per
speed-target phase, its figure beside its floor, the copy of the same bytes
and the NCCL plane's anchor from the same call, the target a dashed line.

Usage: plot_results.py DIR [DIR ...]     (e.g. bench/results/run*)
       plot_results.py --all bench/results  (every subdirectory with CSVs)
Exit status: 0 when every figure was written; 1 on a CSV without the
columns above or a bench JSON without one of its keys (the file and column
or key are named); 2 on a bad command line.
Needs matplotlib: Debian's python3-matplotlib (scripts/install-deps.sh) for
/usr/bin/python3, the interpreter of the shebang.
"""

import argparse
import csv
import json
import os
import sys

import floor_table

REQUIRED = ("ep", "routing", "hidden", "top_k", "tokens", "dispatch_p50_us", "combine_p50_us",
            "dispatch_logical_GBps", "combine_logical_GBps")
# `moe-ep bench --json` (client/bench_command.h): the run's keys and each rank's.
JSON_REQUIRED = ("world", "backend", "routing", "hidden", "top_k", "tokens_per_rank", "ranks")
JSON_RANK_REQUIRED = ("dispatch_p50_us", "combine_p50_us", "dispatch_logical_gbps",
                      "combine_logical_gbps")
OUTPUT_NAME = "bench_plot.png"
FLOOR_OUTPUT_NAME = "floor_plot.png"


class CsvError(Exception):
    pass


def read_rows(path):
    """The rows of one CSV as dicts, numbers converted; CsvError when a column is missing."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise CsvError(f"{path}: no column {', '.join(missing)} (expected moe_ep_bench or "
                           f"baseline_torch.py output)")
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                rows.append({
                    "source": source_label(path, row.get("check", "")),
                    "ep": int(row["ep"]),
                    "routing": row["routing"],
                    "hidden": int(row["hidden"]),
                    "top_k": int(row["top_k"]),
                    "tokens": int(row["tokens"]),
                    "check": row.get("check", ""),
                    "dispatch_us": float(row["dispatch_p50_us"]),
                    "combine_us": float(row["combine_p50_us"]),
                    "dispatch_gbps": float(row["dispatch_logical_GBps"]),
                    "combine_gbps": float(row["combine_logical_GBps"]),
                })
            except ValueError as e:
                raise CsvError(f"{path}:{line}: {e}") from e
    return rows


def json_objects(path):
    """Every JSON value in `path`, one after another (a file of appended runs)."""
    with open(path) as f:
        text = f.read()
    decoder = json.JSONDecoder()
    objects, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return objects
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            raise CsvError(f"{path}: not JSON: {e}") from e
        objects.append(value)


def is_bench_json(path):
    """True when `path` holds `moe-ep bench --json` output (objects with "ranks")."""
    try:
        objects = json_objects(path)
    except (CsvError, OSError, UnicodeDecodeError):
        return False
    return bool(objects) and all(isinstance(o, dict) and "ranks" in o for o in objects)


def read_bench_json(path):
    """One row per run of `moe-ep bench --json` in `path` (see the module comment)."""
    rows = []
    for index, run in enumerate(json_objects(path)):
        where = f"{path} (run {index + 1})"
        missing = [k for k in JSON_REQUIRED if k not in run]
        if missing:
            raise CsvError(f"{where}: no key {', '.join(missing)} (expected `moe-ep bench --json` "
                           f"output)")
        ranks = run["ranks"]
        if not ranks:
            raise CsvError(f"{where}: \"ranks\" is empty")
        for r, rank in enumerate(ranks):
            missing = [k for k in JSON_RANK_REQUIRED if k not in rank]
            if missing:
                raise CsvError(f"{where}: rank {r} has no key {', '.join(missing)}")
        try:
            rows.append({
                "source": f"moe-ep bench ({run['backend']})",
                "ep": int(run["world"]),
                "routing": str(run["routing"]),
                "hidden": int(run["hidden"]),
                "top_k": int(run["top_k"]),
                "tokens": int(run["tokens_per_rank"]),
                "check": "",
                "dispatch_us": max(float(x["dispatch_p50_us"]) for x in ranks),
                "combine_us": max(float(x["combine_p50_us"]) for x in ranks),
                "dispatch_gbps": min(float(x["dispatch_logical_gbps"]) for x in ranks),
                "combine_gbps": min(float(x["combine_logical_gbps"]) for x in ranks),
            })
        except (TypeError, ValueError) as e:
            raise CsvError(f"{where}: {e}") from e
    return rows


def source_label(path, check):
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem.startswith("torch"):
        return "PyTorch baseline"
    label = "moe-ep" if stem == "ep_bench" else f"moe-ep {stem}"
    return f"{label} ({check} check)" if check else label


def series_of(paths):
    """{(source, routing, hidden, top_k, ep): [rows sorted by tokens]}."""
    series = {}
    for path in paths:
        rows = read_bench_json(path) if path.endswith(".json") else read_rows(path)
        for row in rows:
            key = (row["source"], row["routing"], row["hidden"], row["top_k"], row["ep"])
            series.setdefault(key, []).append(row)
    for rows in series.values():
        rows.sort(key=lambda r: r["tokens"])
    return series


def plot_directory(directory, paths):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = series_of(paths)
    if not series:
        raise CsvError(f"{directory}: the results have no rows")
    configs = sorted({(k[2], k[3], k[4]) for k in series})  # (hidden, top_k, ep)
    sources = sorted({k[0] for k in series}, key=lambda s: (s == "PyTorch baseline", s))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    from matplotlib.ticker import FuncFormatter

    # Plain numbers on the log axes, minor ticks labelled at 2x and 5x.
    major = FuncFormatter(lambda v, _: f"{v:g}")
    minor = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")
    width = max(4.8 * len(configs), 10.0)
    fig, axes = plt.subplots(2, len(configs), figsize=(width, 8), squeeze=False)
    for col, (hidden, top_k, ep) in enumerate(configs):
        lat, bw = axes[0][col], axes[1][col]
        for (source, routing, h, k, e), rows in sorted(series.items()):
            if (h, k, e) != (hidden, top_k, ep):
                continue
            tokens = [r["tokens"] for r in rows]
            style = "-" if routing == "uniform" else "--"
            for op_index, op in enumerate(("dispatch", "combine")):
                color = colors[(2 * sources.index(source) + op_index) % len(colors)]
                label = f"{source} {op}, {routing}"
                marker = "o" if op == "dispatch" else "s"
                lat.plot(tokens, [r[f"{op}_us"] for r in rows], style, color=color,
                         marker=marker, markersize=3, label=label)
                bw.plot(tokens, [r[f"{op}_gbps"] for r in rows], style, color=color,
                        marker=marker, markersize=3, label=label)
        lat.set_title(f"EP {ep}, hidden {hidden}, top-{top_k}")
        lat.set_ylabel("p50 latency (us)")
        bw.set_ylabel("logical GB/s")
        for ax in (lat, bw):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.grid(True, which="both", alpha=0.3)
            ax.yaxis.set_major_formatter(major)
            ax.yaxis.set_minor_formatter(minor)
    handles, labels = axes[0][0].get_legend_handles_labels()
    per_row = 4 if len(configs) > 1 else 2
    fig.legend(handles, labels, loc="lower center", ncol=min(per_row, max(1, len(labels))),
               fontsize="small")
    names = ", ".join(os.path.basename(p) for p in paths)
    fig.suptitle(f"{os.path.basename(os.path.abspath(directory))}: {names}")
    rows_of_legend = (len(labels) + per_row - 1) // per_row
    fig.tight_layout(rect=(0, 0.03 + 0.025 * rows_of_legend, 1, 0.97))
    out = os.path.join(directory, OUTPUT_NAME)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_floors(directory):
    """<directory>/floor_plot.png from its floor_bench.csv and onesided_bench.csv."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        rows = floor_table.table(directory)
    except floor_table.FloorError as e:
        raise CsvError(str(e)) from e
    columns = 4
    lines = (len(rows) + columns - 1) // columns
    fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3.6 * lines), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ax in enumerate(axes.flat):
        if i >= len(rows):
            ax.axis("off")
            continue
        r = rows[i]
        bars = [("moe-ep", r["figure"]), ("fixed floor", r["fixed"]), ("copy", r["copy"]),
                ("NCCL EP 1", r["anchor"])]
        # One colour per kind of bar in every panel (a panel may lack the fixed floor).
        color = {"moe-ep": colors[0], "fixed floor": colors[1], "copy": colors[2],
                 "NCCL EP 1": colors[3]}
        bars = [(name, v) for name, v in bars if v is not None]
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color=[color[b[0]] for b in bars])
        for j, (_, v) in enumerate(bars):
            ax.annotate(f"{v:.1f}", (j, v), ha="center", va="bottom", fontsize="small")
        ax.axhline(r["target"], color="black", linestyle="--", linewidth=1)
        ax.set_ylim(0, 1.15 * max([v for _, v in bars] + [r["target"]]))
        verdict = "met" if r["met"] else "not met"
        ax.set_title(f"{r['phase']}\n{r['ratio']:.2f}x floor; target (dashed) "
                     f"{r['target_text']}: {verdict}", fontsize="small")
        ax.set_ylabel("p50 (us)")
        ax.tick_params(axis="x", labelsize="small")
    fig.suptitle(f"{os.path.basename(os.path.abspath(directory))}: each phase against its floor "
                 f"and the NCCL plane, one call")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out = os.path.join(directory, FLOOR_OUTPUT_NAME)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def results_in(directory):
    """The CSVs and the `moe-ep bench --json` files in `directory` (others noted, skipped);
    a floor call's two CSVs are plot_floors' and left out."""
    floor_pair = ((floor_table.FLOOR_CSV, floor_table.PHASE_CSV)
                  if floor_table.has_floor_results(directory) else ())
    paths = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name in floor_pair:
            continue
        if name.endswith(".csv"):
            paths.append(path)
        elif name.endswith(".json"):
            if is_bench_json(path):
                paths.append(path)
            else:
                print(f"plot_results.py: skipping {path}: not `moe-ep bench --json` output",
                      file=sys.stderr)
    return paths


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="*",
                        help="directories holding benchmark CSVs or `moe-ep bench --json` files")
    parser.add_argument("--all", metavar="ROOT",
                        help="every subdirectory of ROOT that holds results")
    args = parser.parse_args(argv)
    dirs = list(args.dirs)
    if args.all:
        dirs += sorted(os.path.join(args.all, d) for d in os.listdir(args.all)
                       if os.path.isdir(os.path.join(args.all, d)))
    found = [(d, results_in(d)) for d in dirs]
    floors = [d for d in dirs if floor_table.has_floor_results(d)]
    found = [(d, paths) for d, paths in found if paths]
    if not found and not floors:
        parser.error("no directory with benchmark CSVs or `moe-ep bench --json` files given")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_results.py: matplotlib is missing (Debian: apt-get install "
              "python3-matplotlib; scripts/install-deps.sh installs it)", file=sys.stderr)
        return 1
    try:
        for d in floors:
            print(plot_floors(d))
        for d, paths in found:
            print(plot_directory(d, paths))
    except CsvError as e:
        print(f"plot_results.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
