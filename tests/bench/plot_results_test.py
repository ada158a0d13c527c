"""ctest bench_plot: bench/plot_results.py on a small CSV fixture and on real
`moe-ep bench --json` output writes a PNG beside them, and refuses a CSV
without the benchmark columns or a bench JSON without a key, naming it
(issue 9 item 10, issue 31 item 5), and a floor call's phases over their
floors as a table and a plot (issue 32 item 3). Exits 77 (ctest: skipped) with the reason when
matplotlib is missing.

Usage: plot_results_test.py SCRIPT FIXTURE_DIR WORK_DIR
"""

import os
import shutil
import struct
import subprocess
import sys
import unittest

SCRIPT, FIXTURE, WORK = sys.argv[1:4]


def png_size(path):
    """(width, height) from the PNG signature and IHDR chunk; ValueError when not a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG")
    return struct.unpack(">II", head[16:24])


class PlotResults(unittest.TestCase):
    def setUp(self):
        shutil.rmtree(WORK, ignore_errors=True)
        os.makedirs(WORK)

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_writes_a_png_beside_the_csvs(self):
        for name in ("ep_bench.csv", "torch.csv"):
            shutil.copy(os.path.join(FIXTURE, name), WORK)
        r = self.run_script(WORK)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(WORK, "bench_plot.png")
        self.assertEqual(r.stdout.strip(), out)
        width, height = png_size(out)
        # One (hidden, top_k) column: the 10 x 8 inch minimum at 100 dpi.
        self.assertEqual((width, height), (1000, 800))

    def test_plots_moe_ep_bench_json_runs(self):
        # Three real `moe-ep bench --json` runs (2 Gloo workers, tokens 8, 32,
        # 128; issue 31 item 5), two of them appended into one file, and a JSON
        # file that is not bench output (skipped with a note).
        shutil.copy(os.path.join(FIXTURE, "bench-gloo-128.json"), WORK)
        with open(os.path.join(WORK, "sweep.json"), "w") as out:  # `>> sweep.json` twice
            for t in (8, 32):
                with open(os.path.join(FIXTURE, f"bench-gloo-{t}.json")) as f:
                    out.write(f.read())
        with open(os.path.join(WORK, "overhead.json"), "w") as f:
            f.write('{"calls": 3}')
        r = self.run_script(WORK)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(WORK, "bench_plot.png")
        self.assertEqual(r.stdout.strip(), out)
        self.assertIn("skipping", r.stderr)
        self.assertIn("overhead.json", r.stderr)
        # One (hidden 256, top-2, EP 2) column.
        self.assertEqual(png_size(out), (1000, 800))

    def test_json_rows_are_the_slowest_ranks(self):
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import plot_results
        rows = plot_results.read_bench_json(os.path.join(FIXTURE, "bench-gloo-8.json"))
        self.assertEqual(len(rows), 1)
        row = rows[0]
        self.assertEqual((row["ep"], row["hidden"], row["top_k"], row["tokens"]), (2, 256, 2, 8))
        self.assertEqual(row["source"], "moe-ep bench (gloo)")
        # The fixture's per-rank values: latency the larger p50, GB/s the smaller.
        self.assertAlmostEqual(row["dispatch_us"], 266.786)
        self.assertAlmostEqual(row["combine_us"], 180.287)
        self.assertAlmostEqual(row["dispatch_gbps"], 0.017812029116970156)
        self.assertAlmostEqual(row["combine_gbps"], 0.03691891262265166)

    def test_refuses_bench_json_without_a_key(self):
        with open(os.path.join(WORK, "bench.json"), "w") as f:
            f.write('{"world": 2, "backend": "gloo", "routing": "uniform", "top_k": 2, '
                    '"tokens_per_rank": 8, "ranks": [{"dispatch_p50_us": 1}]}')
        r = self.run_script(WORK)
        self.assertEqual(r.returncode, 1)
        self.assertIn("bench.json (run 1): no key hidden", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(WORK, "bench_plot.png")))

    def test_refuses_a_csv_without_the_columns(self):
        with open(os.path.join(WORK, "other.csv"), "w") as f:
            f.write("ep,routing,hidden,top_k,tokens\n2,uniform,64,2,1\n")
        r = self.run_script(WORK)
        self.assertEqual(r.returncode, 1)
        self.assertIn("other.csv: no column dispatch_p50_us", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(WORK, "bench_plot.png")))


class FloorPlot(unittest.TestCase):
    """A floor call's directory (floor_bench.csv + onesided_bench.csv; issue 32
    item 3): the fixture's hand values give ratios and verdicts worked out
    here, and the sm path's rows are read, never the ce path's."""

    def setUp(self):
        shutil.rmtree(WORK, ignore_errors=True)
        shutil.copytree(os.path.join(FIXTURE, "floors"), WORK)
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import floor_table
        self.floor_table = floor_table

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_phases_over_their_floors(self):
        rows = {r["phase"]: r for r in self.floor_table.table(WORK)}
        self.assertEqual(len(rows), 7)
        d = rows["dispatch graph, EP 2 thr, 128"]  # 15 over flag/2/graph 5, copy 4
        self.assertEqual((d["figure"], d["fixed"], d["copy"], d["anchor"]), (15.0, 5.0, 4.0, 20.0))
        self.assertAlmostEqual(d["ratio"], 3.0)
        self.assertAlmostEqual(d["copy_ratio"], 3.75)
        self.assertFalse(d["met"])  # 15 > 12
        c = rows["combine graph, EP 2 thr, 128"]  # the ce row's 20 must not be read
        self.assertEqual(c["figure"], 11.0)
        self.assertTrue(c["met"])
        e = rows["combine eager, EP 2 thr, 128"]  # 9 over flag/2/eager 8
        self.assertAlmostEqual(e["ratio"], 1.125)
        self.assertTrue(e["met"])
        s = rows["step graph, EP 1, 128"]  # 16 over step_graph 10, target 15
        self.assertAlmostEqual(s["ratio"], 1.6)
        self.assertFalse(s["met"])
        one = rows["combine graph, EP 1, 4096"]  # 100 against NCCL's 70, copy 40
        self.assertEqual((one["target"], one["floor"]), (70.0, 40.0))
        self.assertAlmostEqual(one["ratio"], 2.5)
        self.assertFalse(one["met"])
        two = rows["combine graph, EP 2 thr, 4096"]  # 96 <= 1.25 x 80
        self.assertAlmostEqual(two["target"], 100.0)
        self.assertAlmostEqual(two["ratio"], 1.2)
        self.assertTrue(two["met"])

    def test_markdown_prints_every_phase(self):
        text = self.floor_table.markdown(self.floor_table.table(WORK))
        self.assertEqual(len(text.splitlines()), 2 + 7)
        self.assertIn("| step graph, EP 1, 128 | 16.00 | 10.00 (step_graph/1/eager) | 1.60 |", text)

    def test_writes_floor_plot_beside_the_bench_plot(self):
        shutil.copy(os.path.join(FIXTURE, "ep_bench.csv"), WORK)
        r = self.run_script(WORK)
        self.assertEqual(r.returncode, 0, r.stderr)
        floor_png = os.path.join(WORK, "floor_plot.png")
        bench_png = os.path.join(WORK, "bench_plot.png")
        self.assertEqual(r.stdout.split(), [floor_png, bench_png])
        # 7 phases: 2 lines of 4 panels, 16 x 7.2 inches at 100 dpi.
        self.assertEqual(png_size(floor_png), (1600, 720))
        self.assertEqual(png_size(bench_png), (1000, 800))

    def test_refuses_a_floor_file_without_a_piece(self):
        path = os.path.join(WORK, "floor_bench.csv")
        with open(path) as f:
            kept = [line for line in f if not line.startswith("flag,2,eager")]
        with open(path, "w") as f:
            f.writelines(kept)
        r = self.run_script(WORK)
        self.assertEqual(r.returncode, 1)
        self.assertIn("floor_bench.csv: no row flag ranks 2 mode eager", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(WORK, "floor_plot.png")))


if __name__ == "__main__":
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"SKIP: {sys.executable} has no matplotlib (Debian: python3-matplotlib; "
              "scripts/install-deps.sh installs it)")
        sys.exit(77)
    unittest.main(argv=sys.argv[:1], verbosity=2)
