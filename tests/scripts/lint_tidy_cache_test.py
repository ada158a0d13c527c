"""scripts/lint.sh's clang-tidy cache (issue 34 item 5) on a small project.

Copies scripts/lint.sh, scripts/tidy_cache.py, .clang-format and .clang-tidy
into a fresh git repository holding core/main.cc -> core/a.h -> core/b.h, an
unrelated core/other.cc and core/lonely.h, which nothing includes (lint.sh
tidies b.h and lonely.h on their own: no .cc includes them), writes its
compile_commands.json, and runs the real lint.sh (clang-format, g++ -MM,
clang-tidy-14) on it:
  - --update-tidy-cache tidies every file and records one sorted key per file;
  - a warm run tidies nothing;
  - editing b.h, which main.cc includes only through a.h, re-tidies main.cc
    and b.h alone, and again on every run until the cache is updated;
  - editing .clang-tidy re-tidies everything;
  - a file with a finding fails the run and is never recorded;
  - a file whose includes cannot be resolved has no key and is tidied;
  - MOE_EP_TIDY_CACHE=0 tidies every file.
Run by ctest (tests/scripts.cmake, label lint) with /usr/bin/python3.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = all(shutil.which(t) for t in ("clang-tidy-14", "clang-format", "g++", "git"))

FILES = {
    "core/b.h": "#pragma once\n\ninline int B() { return 2; }\n",
    "core/a.h": '#pragma once\n\n#include "core/b.h"\n\ninline int A() { return B() + 1; }\n',
    "core/main.cc": '#include "core/a.h"\n\nint Main() { return A(); }\n',
    "core/other.cc": "int Other() { return 7; }\n",
    "core/lonely.h": "#pragma once\n\ninline int Lonely() { return 3; }\n",
}


class LintTidyCacheTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="moe-ep-tidy-cache-")
        d = self.dir
        os.makedirs(os.path.join(d, "scripts"))
        for name in ("scripts/lint.sh", "scripts/tidy_cache.py", ".clang-format", ".clang-tidy"):
            shutil.copy2(os.path.join(ROOT, name), os.path.join(d, name))
        for name, text in FILES.items():
            self.write(name, text)
        self.git("init", "-q")
        self.git("add", ".")
        self.write_commands()
        self.cache = os.path.join(d, ".ci", "tidy-clean.txt")

    def write_commands(self, flags="-O2"):
        d = self.dir
        build = os.path.join(d, "build")
        os.makedirs(build, exist_ok=True)
        commands = [
            {
                "directory": build,
                "command": f"/usr/bin/c++ -I{d} {flags} -std=gnu++20 -o {cc}.o -c {d}/{cc}",
                "file": f"{d}/{cc}",
            }
            for cc in ("core/main.cc", "core/other.cc")
        ]
        with open(os.path.join(build, "compile_commands.json"), "w") as f:
            json.dump(commands, f)

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def git(self, *args):
        subprocess.run(["git", *args], cwd=self.dir, check=True, capture_output=True)

    def lint(self, *args, env=None, expect=0):
        e = {k: v for k, v in os.environ.items() if not k.startswith("MOE_EP_TIDY")}
        e.update(env or {})
        r = subprocess.run(
            ["bash", "scripts/lint.sh", *args], cwd=self.dir, env=e, capture_output=True, text=True
        )
        out = r.stdout + r.stderr
        self.assertEqual(r.returncode, expect, out)
        m = re.search(r"clang-tidy on (\d+) of (\d+) files", out)
        self.assertIsNotNone(m, out)
        return int(m.group(1)), int(m.group(2)), out

    def keys(self):
        with open(self.cache) as f:
            return f.read().splitlines()

    def test_cache_skips_only_unchanged_inputs(self):
        # Cold: every file is tidied; one key per file, sorted, 64 hex digits.
        self.assertEqual(self.lint("--update-tidy-cache")[:2], (4, 4))
        keys = self.keys()
        self.assertEqual(len(keys), 4)
        self.assertEqual(keys, sorted(keys))
        self.assertTrue(all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys), keys)
        # Warm: nothing is tidied.
        self.assertEqual(self.lint()[:2], (0, 4))

        # A header main.cc reaches only through a.h: main.cc and b.h itself
        # are tidied (not other.cc, lonely.h), on every run until the cache
        # is updated.
        self.write("core/b.h", FILES["core/b.h"].replace("return 2", "return 4"))
        tidied, _, out = self.lint()
        self.assertEqual(tidied, 2, out)
        self.assertEqual(self.lint()[:2], (2, 4))
        self.assertEqual(self.lint("--update-tidy-cache")[:2], (2, 4))
        updated = self.keys()
        self.assertEqual(len(updated), 4)
        self.assertEqual(len(set(updated) - set(keys)), 2)  # new keys; the old ones gone
        self.assertEqual(self.lint()[:2], (0, 4))
        # Putting b.h back: its first keys again (content, not time), which
        # the updated cache no longer holds.
        self.write("core/b.h", FILES["core/b.h"])
        self.assertEqual(self.lint()[:2], (2, 4))

        # .clang-tidy is an input of every file.
        self.lint("--update-tidy-cache")
        with open(os.path.join(self.dir, ".clang-tidy"), "a") as f:
            f.write("# a comment changes the bytes\n")
        self.assertEqual(self.lint()[:2], (4, 4))

        # A compile flag is an input too.
        self.lint("--update-tidy-cache")
        self.write_commands("-O2 -DEXTRA=1")
        self.assertEqual(self.lint()[:2], (4, 4))
        self.write_commands()

        # MOE_EP_TIDY_CACHE=0 tidies every file even with a fresh cache.
        self.lint("--update-tidy-cache")
        self.assertEqual(self.lint(env={"MOE_EP_TIDY_CACHE": "0"})[:2], (4, 4))

    def test_a_clone_elsewhere_hits_the_cache(self):
        """Keys name paths relative to the source and build trees (CI clones anywhere)."""
        self.lint("--update-tidy-cache")
        clone = self.dir + "-clone"
        shutil.copytree(self.dir, clone, symlinks=True)
        try:
            self.dir, original = clone, self.dir
            self.write_commands()  # the clone's own absolute paths
            self.assertEqual(self.lint()[:2], (0, 4))
        finally:
            self.dir = original
            shutil.rmtree(clone, ignore_errors=True)

    def test_a_finding_is_never_recorded(self):
        self.lint("--update-tidy-cache")
        # modernize-use-nullptr (in .clang-tidy): a finding in other.cc.
        self.write("core/other.cc", "int* Other() { return 0; }\n")
        tidied, total, out = self.lint("--update-tidy-cache", expect=1)
        self.assertEqual((tidied, total), (1, 4))
        self.assertIn("modernize-use-nullptr", out)
        self.assertEqual(len(self.keys()), 3)  # not other.cc's
        self.assertEqual(self.lint(expect=1)[:2], (1, 4))
        # MOE_EP_TIDY_STRICT=0 lists it without failing.
        self.assertEqual(self.lint(env={"MOE_EP_TIDY_STRICT": "0"})[:2], (1, 4))

    def test_unresolvable_includes_mean_no_key(self):
        self.lint("--update-tidy-cache")
        self.write("core/other.cc", '#include "core/missing.h"\n\nint Other() { return 7; }\n')
        tidied, total, out = self.lint("--update-tidy-cache", expect=1)
        self.assertEqual((tidied, total), (1, 4))
        self.assertIn("no key for core/other.cc", out)
        self.assertEqual(len(self.keys()), 3)

    def test_bad_argument_exits_2(self):
        r = subprocess.run(
            ["bash", "scripts/lint.sh", "--update-cache"], cwd=self.dir, capture_output=True
        )
        self.assertEqual(r.returncode, 2)


if __name__ == "__main__":
    if not TOOLS:
        print("SKIP: needs clang-tidy-14, clang-format, g++ and git")
        raise SystemExit(77)
    unittest.main()
