"""ctest bench_plot: bench/plot_results.py on a small CSV fixture writes a PNG
beside the CSVs, and refuses a CSV without the benchmark columns naming the
column (issue 9 item 10). Exits 77 (ctest: skipped) with the reason when
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

    def test_refuses_a_csv_without_the_columns(self):
        with open(os.path.join(WORK, "other.csv"), "w") as f:
            f.write("ep,routing,hidden,top_k,tokens\n2,uniform,64,2,1\n")
        r = self.run_script(WORK)
        self.assertEqual(r.returncode, 1)
        self.assertIn("other.csv: no column dispatch_p50_us", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(WORK, "bench_plot.png")))


if __name__ == "__main__":
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"SKIP: {sys.executable} has no matplotlib (Debian: python3-matplotlib; "
              "scripts/install-deps.sh installs it)")
        sys.exit(77)
    unittest.main(argv=sys.argv[:1], verbosity=2)
