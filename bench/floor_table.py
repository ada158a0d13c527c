#!/usr/bin/python3
"""Each speed-target phase as a ratio to its floor measured in the same call (issue 32 items 1, 3).

A call's directory holds floor_bench.csv (moe_ep_floor_bench: the
irreducible pieces) and onesided_bench.csv (moe_ep_onesided_bench: the
phases, the NCCL plane's beside them). PHASES below says which piece
floors which phase:
  fixed floor  what a phase of its kind cannot do without — one kernel
               with the flag store and acquire spin across the ranks
               (graph-replayed or eager, as the phase was timed), or
               ReplayForward's node rewrite and two-kernel graph launch for
               the whole step;
  copy floor   cudaMemcpyAsync device-to-device of the same bytes, the
               same ranks copying at once.
The ratio is the phase over its fixed floor where the target is a latency,
over the copy where it is a bandwidth (4096 tokens). The anchor is the NCCL
plane's same phase at EP 1 from the same call.

Usage: floor_table.py DIR   prints the Markdown table of DIR's call.
plot_results.py draws the same rows (floor_plot.png).
"""

import csv
import os
import sys

FLOOR_CSV = "floor_bench.csv"
PHASE_CSV = "onesided_bench.csv"
FLOOR_COLUMNS = ("piece", "ranks", "mode", "bytes", "p10_us", "p50_us", "p90_us", "samples")
PHASE_COLUMNS = ("plane", "ep", "tokens", "path", "graph_dispatch_p50_us", "graph_combine_p50_us",
                 "graph_step_p50_us", "eager_dispatch_p50_us", "eager_combine_p50_us")


class FloorError(Exception):
    pass


# (label, (ep, tokens, column) of the one-sided sm row, fixed floor piece,
#  copy floor piece, target kind, target value); a piece is (name, ranks,
#  mode). Target kinds: "us" (at most value µs), "anchor" (at most the NCCL
#  plane's figure), "copy" (at most value x the copy floor).
PHASES = (
    ("dispatch graph, EP 2 thr, 128", (2, 128, "graph_dispatch_p50_us"), ("flag", 2, "graph"),
     ("copy_dispatch_128", 2, "graph"), "us", 12.0),
    ("combine graph, EP 2 thr, 128", (2, 128, "graph_combine_p50_us"), ("flag", 2, "graph"),
     ("copy_combine_128", 2, "graph"), "us", 12.0),
    ("dispatch eager, EP 2 thr, 128", (2, 128, "eager_dispatch_p50_us"), ("flag", 2, "eager"),
     ("copy_dispatch_128", 2, "graph"), "us", 10.0),
    ("combine eager, EP 2 thr, 128", (2, 128, "eager_combine_p50_us"), ("flag", 2, "eager"),
     ("copy_combine_128", 2, "graph"), "us", 10.0),
    ("step graph, EP 1, 128", (1, 128, "graph_step_p50_us"), ("step_graph", 1, "eager"),
     ("copy_dispatch_128", 1, "graph"), "us", 15.0),
    ("combine graph, EP 1, 4096", (1, 4096, "graph_combine_p50_us"), None,
     ("copy_combine_4096", 1, "graph"), "anchor", 1.0),
    ("combine graph, EP 2 thr, 4096", (2, 4096, "graph_combine_p50_us"), None,
     ("copy_combine_4096", 2, "graph"), "copy", 1.25),
)


def _rows(path, required):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise FloorError(f"{path}: no column {', '.join(missing)}")
        return list(reader)


def read_floors(path):
    """{(piece, ranks, mode): p50 µs} of a floor_bench.csv."""
    try:
        return {(r["piece"], int(r["ranks"]), r["mode"]): float(r["p50_us"])
                for r in _rows(path, FLOOR_COLUMNS)}
    except ValueError as e:
        raise FloorError(f"{path}: {e}") from e


def read_phases(path):
    """{(plane, ep, tokens): row} of an onesided_bench.csv: the sm path's rows and NCCL's."""
    phases = {}
    for r in _rows(path, PHASE_COLUMNS):
        if r["plane"] == "onesided" and r["path"] != "sm":
            continue
        try:
            phases[(r["plane"], int(r["ep"]), int(r["tokens"]))] = {
                c: float(r[c]) for c in PHASE_COLUMNS[4:]}
        except ValueError as e:
            raise FloorError(f"{path}: {e}") from e
    return phases


def has_floor_results(directory):
    return all(os.path.isfile(os.path.join(directory, n)) for n in (FLOOR_CSV, PHASE_CSV))


def table(directory):
    """One dict per PHASES entry; FloorError naming what a file lacks."""
    floors = read_floors(os.path.join(directory, FLOOR_CSV))
    phases = read_phases(os.path.join(directory, PHASE_CSV))

    def floor(piece):
        if piece is None:
            return None
        if piece not in floors:
            raise FloorError(f"{directory}/{FLOOR_CSV}: no row {piece[0]} ranks {piece[1]} "
                             f"mode {piece[2]}")
        return floors[piece]

    def phase(plane, ep, tokens, column):
        if (plane, ep, tokens) not in phases:
            raise FloorError(f"{directory}/{PHASE_CSV}: no {plane} row at EP {ep}, "
                             f"{tokens} tokens")
        return phases[(plane, ep, tokens)][column]

    out = []
    for label, (ep, tokens, column), fixed_piece, copy_piece, kind, value in PHASES:
        figure = phase("onesided", ep, tokens, column)
        # The NCCL plane refuses two ranks on one GPU: its anchor is EP 1.
        anchor = phase("nccl", 1, tokens, column)
        fixed, copy = floor(fixed_piece), floor(copy_piece)
        if kind == "us":
            target, target_text = value, f"<= {value:g} us"
        elif kind == "anchor":
            target, target_text = anchor, "<= NCCL EP 1"
        else:
            target, target_text = value * copy, f"<= {value:g}x copy"
        base = fixed if fixed is not None else copy
        out.append({
            "phase": label, "figure": figure, "fixed": fixed, "copy": copy, "anchor": anchor,
            "floor": base, "floor_piece": "/".join(map(str, fixed_piece or copy_piece)),
            "ratio": figure / base, "copy_ratio": figure / copy, "target": target,
            "target_text": target_text, "met": figure <= target,
        })
    return out


def markdown(rows):
    def num(v):
        return "-" if v is None else f"{v:.2f}"

    lines = ["| phase | figure us | floor (piece) us | ratio | copy of the bytes us | x copy | "
             "NCCL EP 1 us | target | met |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {num(r['figure'])} | {num(r['floor'])} "
                     f"({r['floor_piece']}) | {r['ratio']:.2f} | {num(r['copy'])} | "
                     f"{r['copy_ratio']:.2f} | {num(r['anchor'])} | {r['target_text']} "
                     f"({r['target']:.1f}) | {'yes' if r['met'] else 'no'} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) != 1:
        print("usage: floor_table.py DIR", file=sys.stderr)
        return 2
    try:
        print(markdown(table(argv[0])))
    except (FloorError, OSError) as e:
        print(f"floor_table.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
