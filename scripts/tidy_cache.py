#!/usr/bin/python3
"""Content keys of clang-tidy's inputs, for scripts/lint.sh's cache (issue 34 item 5).

A file's key is the SHA-256 of everything that can change what clang-tidy
says about it:
  - a format tag and the flags scripts/lint.sh gives clang-tidy (--tidy-args);
  - the clang-tidy version line ("Debian LLVM version 14.0.6": the host CPU
    line of `--version` is left out, it names the machine, not the tool);
  - .clang-tidy's bytes;
  - the file's repository path and its compile commands from
    compile_commands.json, with the source and build directories written as
    <src> and <build> (so a clone elsewhere gets the same key), the CUDA
    toolkit's paths under /usr/local/cuda whatever link or nvcc wrapper the
    build reached it by (CUDA_ROOT_KEY), without the object file (-o);
  - the path and bytes of every project file the preprocessor reads for it:
    the compiler's own dependency output (`-MM`: the file itself and every
    header it includes transitively, system headers left out), including the
    generated headers in the build directory (build/proto/...*.pb.h).
Any change to any of these changes the key, so a file is skipped only when
none of its inputs changed since it was last tidied clean. A file whose
dependencies cannot be computed (the compiler fails, a generated header is
missing) gets no key and is always tidied.

A file with no compile command (a header no .cc includes, a .cc outside the
build) has its dependencies listed with the command of the nearest .cc in the
database, compiled as C++ (-x c++); since clang-tidy's own interpolation may
pick another entry near it (even a .cu's nvcc command), every compile command
of the nearest directory (at or above the file's) that has any is part of its
key too.

A unity build (the libraries and test binaries: MOE_EP_UNITY_BUILD in
CMakeLists.txt) compiles batches of sources as one file
(".../Unity/unity_N_cxx.cxx", a list of #include lines), and
compile_commands.json names only the batches. Each batch entry is read
as one entry per source it includes, with the batch's command on that source:
the command the source has without the unity build, so its key is the same
either way and clang-tidy (given the expanded database: `compdb`) tidies each
source with its own command.

A .cu file (issue 34 item 3) is tidied by clang-tidy 19 as clang's CUDA:
with --cuda-clang CLANG --cuda-shim DIR, its nvcc command is read as the clang
command `cuda_command` writes (DIR holds the generated headers, CUDA_SHIM), and
its key hashes that command (DIR written as <cuda-shim>), its -MM list under
it, the nvcc release line and the generated headers' text; compdb --cuda-out
writes those commands as a database of their own for clang-tidy 19.

Usage (keys and inputs take --tidy BINARY --tidy-args "FLAGS", as lint.sh passes them):
  tidy_cache.py keys --build-dir DIR [--jobs N] FILE...
      prints "KEY PATH" per file (KEY "-" when it has none), in input order.
  tidy_cache.py inputs --build-dir DIR FILE
      prints what FILE's key hashes (one input per line), to see why it changed.
  tidy_cache.py compdb --build-dir DIR --out OUT
                       [--cuda-out CUDB --cuda-clang CLANG --cuda-shim SHIM]
      writes OUT/compile_commands.json: DIR's, unity batches expanded (and
      CUDB/compile_commands.json: the .cu entries as clang's; SHIM's headers).
The cache itself (.ci/tidy-clean.txt: one key per line, sorted) is read and
written by scripts/lint.sh. Standard library only; Python >= 3.9.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

FORMAT_TAG = b"moe-ep tidy cache v1\n"


def tidy_version(tidy: str) -> str:
    out = subprocess.run([tidy, "--version"], check=True, capture_output=True, text=True).stdout
    lines = [line.strip() for line in out.splitlines() if "version" in line.lower()]
    if not lines:
        raise RuntimeError(f"{tidy} --version printed no version line: {out!r}")
    return lines[0]


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


UNITY_BATCH = re.compile(r"/Unity/unity_[^/]*\.(cxx|c|cu)$")
UNITY_MEMBER = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def expand_unity(entries: List[dict]) -> List[dict]:
    """`entries` with each unity batch replaced by one entry per source it includes
    (the batch's command, the batch's path replaced by the source's)."""
    out: List[dict] = []
    for e in entries:
        batch = os.path.join(e["directory"], e["file"])
        if not UNITY_BATCH.search(batch):
            out.append(e)
            continue
        try:
            with open(batch) as f:
                members = UNITY_MEMBER.findall(f.read())
        except OSError:
            out.append(e)  # not generated yet: nothing to expand
            continue
        for member in members:
            m = dict(e, file=member)
            if "arguments" in e:
                m["arguments"] = [member if a in (e["file"], batch) else a for a in e["arguments"]]
            else:
                argv = shlex.split(e["command"])
                m["command"] = shlex.join(member if a in (e["file"], batch) else a for a in argv)
            out.append(m)
    return out


# CUDA sources (.cu) are tidied by a newer clang-tidy, which parses them as
# clang's CUDA (scripts/lint.sh: clang-tidy 14 cannot read CUDA 13's headers).
# Their compile commands are nvcc's; `cuda_command` rewrites one as the clang
# command that parses the same translation unit for the host (--cuda-host-only:
# the host pass sees every __global__ / __device__ body too; only code under
# `#if __CUDA_ARCH__` would be left out, and the kernels have none).
# Two generated headers (`write_cuda_shim`, in a folder of lint.sh's) make
# clang 19 read CUDA 13 as nvcc does; each is small and changes no code:
#  - texture_fetch_functions.h, empty: clang 19's __clang_cuda_runtime_wrapper.h
#    includes it, CUDA 13 no longer ships it (texture references are gone since
#    CUDA 12); LLVM PR 151766 (clang 21) drops the include, as this does.
#  - moe_ep_cuda_tidy.h, included first (-include, after clang's wrapper):
#    nvcc defines __CUDACC__ as 1, clang's wrapper defines it empty, so NCCL's
#    device headers' `#if __CUDACC__` (nccl_device/*.h) do not parse; this
#    defines it as nvcc does. And clang 19 keeps CUDA's sm_32_intrinsics.h
#    out and defines only some of its functions: not the write-through store
#    __stwt, which nccl_device/gin/proxy/gin_proxy.h calls; this declares it
#    (the host pass generates no device code, so nothing needs its body).
CUDA_SHIM = {
    "texture_fetch_functions.h": (
        "// Empty: clang 19 includes this header, CUDA 13 no longer ships it\n"
        "// (written by scripts/tidy_cache.py for clang-tidy only).\n"
    ),
    "moe_ep_cuda_tidy.h": (
        "// __CUDACC__ as nvcc defines it (clang's CUDA wrapper defines it empty;\n"
        "// written by scripts/tidy_cache.py for clang-tidy only).\n"
        "#undef __CUDACC__\n"
        "#define __CUDACC__ 1\n"
        "// CUDA's write-through store (sm_32_intrinsics.h), which clang 19 lacks.\n"
        "template <typename T>\n"
        "__device__ void __stwt(T* ptr, T value);\n"
    ),
}
CUDA_SHIM_INCLUDE = "moe_ep_cuda_tidy.h"
NVCC_DROPPED = {"-forward-unknown-to-host-compiler", "-c"}


# Keys write the CUDA toolkit's root as the NVIDIA installers' link names it,
# whatever path a build reached it by (CMake may find nvcc as /usr/local/cuda/bin/
# nvcc here and as a wrapper script /usr/local/bin/nvcc that execs
# /usr/local/cuda-13.0/bin/nvcc on CI, and the include folders follow): the same
# toolkit then gives the same key. Its release is hashed apart (`nvcc_version`).
CUDA_ROOT_KEY = "/usr/local/cuda"


def toolkit_root(argv: Sequence[str]) -> str:
    """The real root of the CUDA toolkit an nvcc command compiles against.

    It is the parent of the include folder (-isystem / -I, CMake's
    CUDAToolkit_INCLUDE_DIRS) that holds cuda_runtime.h, else the parent of the
    folder nvcc really lies in. nvcc's own path is not enough: it may be a
    wrapper script outside the toolkit. Raises RuntimeError when neither holds
    cuda_runtime.h.
    """
    for i, a in enumerate(argv):
        d = None
        if a in ("-isystem", "-I") and i + 1 < len(argv):
            d = argv[i + 1]
        elif a.startswith("-isystem="):
            d = a[len("-isystem=") :]
        elif a.startswith("-I") and len(a) > 2:
            d = a[2:]
        if d and os.path.isfile(os.path.join(d, "cuda_runtime.h")):
            return os.path.dirname(os.path.realpath(d))
    nvcc = os.path.realpath(shutil.which(argv[0]) or argv[0])
    root = os.path.dirname(os.path.dirname(nvcc))
    if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
        return root
    raise RuntimeError(f"{argv[0]}: no CUDA toolkit (no include folder with cuda_runtime.h)")


def cuda_command(entry: dict, clang: str, shim: str) -> List[str]:
    """The clang argv (CUDA, host side) that parses what the nvcc `entry` compiles.

    Keeps the preprocessor and language flags (-D -U -I -isystem -std -O -g -f -W,
    the host flags of -Xcompiler=), maps --generate-code's first sm_XX to
    --cuda-gpu-arch, adds the toolkit's CCCL headers (nvcc's implicit
    include/cccl) and the shim folder. Raises RuntimeError on an nvcc flag it
    does not know, so a new one is noticed rather than silently dropped.
    """
    argv = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    cuda = toolkit_root(argv)
    src = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
    archs: List[str] = []
    kept: List[str] = []
    i = 1
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if a in ("-o", "-x") or a in NVCC_DROPPED:
            i += 2 if a in ("-o", "-x") else 1
            continue
        if os.path.realpath(os.path.join(entry["directory"], a)) == src:
            i += 1
            continue
        if a.startswith("--generate-code=") or a.startswith("-gencode="):
            archs += re.findall(r"sm_[0-9]+[a-z]?", a)
        elif a.startswith("-Xcompiler="):
            kept += [f for f in a[len("-Xcompiler=") :].split(",") if f]
        elif a.startswith("-isystem="):
            kept += ["-isystem", a[len("-isystem=") :]]
        elif a in ("-isystem", "-I", "-D", "-U") and nxt is not None:
            kept += [a, nxt]
            i += 1
        elif re.match(r"-(D|U|I|std=|O|g|f|W)", a) and not a.startswith("--"):
            kept.append(a)
        else:
            raise RuntimeError(f"{entry['file']}: nvcc flag {a!r} has no clang translation")
        i += 1
    return [
        clang,
        "-x",
        "cuda",
        "--cuda-host-only",
        f"--cuda-path={cuda}",
        f"--cuda-gpu-arch={archs[0] if archs else 'sm_90a'}",
        "-nocudalib",
        "-Wno-unknown-cuda-version",
        *kept,
        "-isystem",
        os.path.join(cuda, "include", "cccl"),
        "-isystem",
        shim,
        "-include",
        os.path.join(shim, CUDA_SHIM_INCLUDE),
        "-c",
        src,
    ]


def cuda_entries(entries: List[dict], clang: str, shim: str) -> List[dict]:
    """The .cu entries of `entries`, as clang commands (see `cuda_command`)."""
    return [
        {"directory": e["directory"], "file": e["file"], "arguments": cuda_command(e, clang, shim)}
        for e in entries
        if e["file"].endswith(".cu")
    ]


def write_cuda_shim(shim: str) -> None:
    os.makedirs(shim, exist_ok=True)
    for name, text in CUDA_SHIM.items():
        with open(os.path.join(shim, name), "w") as f:
            f.write(text)


def cuda_shim_digest() -> str:
    h = hashlib.sha256()
    for name in sorted(CUDA_SHIM):
        h.update(f"{name}\n{CUDA_SHIM[name]}\n".encode())
    return h.hexdigest()


def nvcc_version(nvcc: str) -> str:
    """nvcc's release line ("Cuda compilation tools, release 13.0, V13.0.88")."""
    out = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
    lines = [line.strip() for line in out.splitlines() if "release" in line]
    if not lines:
        raise RuntimeError(f"{nvcc} --version printed no release line: {out!r}")
    return lines[-1]


def without_output(entry: dict) -> str:
    """An entry's command without its "-o OBJECT" (which names a unity batch's object
    when the entry came from one: not an input of clang-tidy)."""
    argv = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    kept = [a for i, a in enumerate(argv) if a != "-o" and (i == 0 or argv[i - 1] != "-o")]
    return shlex.join(kept)


class Database:
    """compile_commands.json, indexed by absolute file path."""

    def __init__(self, root: str, build_dir: str, cuda: Optional[Tuple[str, str]] = None):
        """`cuda`: (clang, shim folder) to read .cu files' nvcc commands as clang's
        (`cuda_command`); without it a .cu file has no key."""
        self.root = os.path.realpath(root)
        self.build = os.path.realpath(build_dir)
        self.cuda = (cuda[0], os.path.realpath(cuda[1])) if cuda else None
        with open(os.path.join(self.build, "compile_commands.json")) as f:
            entries = expand_unity(json.load(f))
        self.by_file: Dict[str, List[dict]] = {}
        for e in entries:
            path = os.path.realpath(os.path.join(e["directory"], e["file"]))
            self.by_file.setdefault(path, []).append(e)
        self.cc_files = sorted(p for p in self.by_file if p.endswith(".cc"))
        nvcc = [e for es in self.by_file.values() for e in es if e["file"].endswith(".cu")]
        self.toolkit: Optional[str] = None
        if nvcc:
            first = nvcc[0]
            argv = first["arguments"] if "arguments" in first else shlex.split(first["command"])
            self.toolkit = toolkit_root(argv)

    def normalize(self, text: str) -> str:
        """Absolute source / build paths as <src> / <build> (build first: it may lie in src),
        and no -Werror: scripts/lint.sh runs clang-tidy with -Wno-error, so a build with
        or without MOE_EP_WERROR tidies alike and shares its keys. Any debug-info level
        (-g, -g1, ...) reads as -g: it changes no line of the AST, so builds with line
        tables only (the default) and with full debug info share keys. Any optimisation
        level reads as -O2: it changes only the __OPTIMIZE__ / __NO_INLINE__ macros, which
        the project's sources never read, so the test sources (tests/CMakeLists.txt
        MOE_EP_TEST_OPT, -O0) share keys with an -O2 build of them."""
        text = re.sub(r" -Werror(?=\s|$)", "", text)
        text = re.sub(r" -g[0-3]?(?=\s|$)", " -g", text)
        text = re.sub(r" -O[0-3sg]?(?=\s|$)", " -O2", text)
        if self.cuda:
            text = text.replace(self.cuda[1], "<cuda-shim>")
        if self.toolkit:
            text = self.toolkit_paths(text)
        return text.replace(self.build, "<build>").replace(self.root, "<src>")

    def toolkit_paths(self, text: str) -> str:
        """`text` with every path into the CUDA toolkit, by whatever link it went,
        written under CUDA_ROOT_KEY, and a leading nvcc (maybe a wrapper) as
        CUDA_ROOT_KEY/bin/nvcc."""
        argv0, sep, rest = text.partition(" ")
        if os.path.basename(argv0) == "nvcc":
            text = f"{CUDA_ROOT_KEY}/bin/nvcc{sep}{rest}"

        def rewrite(m: "re.Match[str]") -> str:
            path = m.group(0)
            real = os.path.realpath(path)
            if real == self.toolkit or real.startswith(self.toolkit + os.sep):
                return CUDA_ROOT_KEY + real[len(self.toolkit) :]
            return path

        return re.sub(r"/[^\s'\"=,]+", rewrite, text)

    def name(self, path: str) -> Optional[str]:
        """A dependency's key name: its path under <build> or <src>; None outside both."""
        real = os.path.realpath(path)
        bases = [(self.build, "<build>"), (self.root, "<src>")]
        if self.cuda:
            bases.insert(0, (self.cuda[1], "<cuda-shim>"))
        for base, tag in bases:
            if real == base or real.startswith(base + os.sep):
                return tag + "/" + os.path.relpath(real, base)
        return None

    def nearest(self, path: str) -> str:
        """The database .cc sharing the longest directory prefix with `path` (then by stem)."""
        stem = os.path.splitext(os.path.basename(path))[0]
        directory = os.path.dirname(path)

        def rank(candidate: str) -> Tuple[int, int, str]:
            common = os.path.commonpath([directory, os.path.dirname(candidate)])
            same_stem = os.path.splitext(os.path.basename(candidate))[0] == stem
            return (-len(common), -int(same_stem), candidate)

        return min(self.cc_files, key=rank)

    def directory_commands(self, path: str) -> List[str]:
        """Every compile command of the database files in the nearest directory
        at or above `path`'s that has any, sorted."""
        directory = os.path.dirname(path)
        while True:
            found = sorted(
                without_output(e)
                for f, entries in self.by_file.items()
                if os.path.dirname(f) == directory
                for e in entries
            )
            parent = os.path.dirname(directory)
            if found or parent == directory or not directory.startswith(self.root):
                return found
            directory = parent

    def commands(self, path: str) -> List[Tuple[str, List[str]]]:
        """(directory, argv) of each compile command of `path` (interpolated when it has none)."""
        entries = self.by_file.get(path)
        interpolated = entries is None
        if path.endswith(".cu"):
            if self.cuda is None or interpolated:
                raise RuntimeError(f"{path}: a .cu file needs its nvcc command and --cuda-clang")
            clang, shim = self.cuda
            entries = [dict(e, arguments=cuda_command(e, clang, shim)) for e in entries]
        if interpolated:
            entries = self.by_file[self.nearest(path)]
        out = []
        for e in entries:
            argv = e["arguments"] if "arguments" in e else shlex.split(e["command"])
            src = os.path.realpath(os.path.join(e["directory"], e["file"]))
            fixed: List[str] = []
            skip = False
            for i, a in enumerate(argv):
                if skip:
                    skip = False
                    continue
                if a == "-o":
                    skip = True
                    continue
                if a == "-c":
                    continue
                if os.path.realpath(os.path.join(e["directory"], a)) == src and i > 0:
                    continue  # the file itself; added back below
                fixed.append(a)
            if interpolated:
                fixed += ["-x", "c++"]
            out.append((e["directory"], fixed))
        return out


def dependencies(directory: str, argv: Sequence[str], path: str) -> List[str]:
    """The compiler's -MM list for `path` under `argv` (absolute paths)."""
    result = subprocess.run(
        [*argv, "-MM", path], cwd=directory, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{path}: {argv[0]} -MM failed: {result.stderr.strip()[:500]}")
    text = result.stdout.replace("\\\n", " ")
    _, _, deps = text.partition(":")
    return [os.path.join(directory, d) for d in deps.split()]


def material(db: Database, header: bytes, relpath: str) -> bytes:
    """What the key hashes for `relpath` (see the module comment).

    Raises RuntimeError or OSError when its inputs cannot be listed.
    """
    path = os.path.realpath(os.path.join(db.root, relpath))
    lines = [f"file {relpath}\n"]
    deps: Dict[str, str] = {}
    if path.endswith(".cu") and path in db.by_file and db.cuda:
        # clang-tidy reads the toolkit's headers (system headers: not in -MM),
        # so its release and the shim that makes clang read it are inputs.
        nvcc = db.by_file[path][0]
        nvcc_argv = nvcc["arguments"] if "arguments" in nvcc else shlex.split(nvcc["command"])
        lines.append(f"cuda {nvcc_version(nvcc_argv[0])}\ncuda-shim {cuda_shim_digest()}\n")
    for directory, argv in db.commands(path):
        lines.append("command " + db.normalize(shlex.join(argv)) + "\n")
        for dep in dependencies(directory, argv, path):
            name = db.name(dep) or os.path.realpath(dep)  # outside the tree: still an input
            deps[name] = dep
    if not deps:
        raise RuntimeError(f"{relpath}: the compiler listed no dependency")
    if path not in db.by_file:
        # clang-tidy interpolates from any entry (a .cu's nvcc command too):
        # every command of the file's directory is an input as well.
        for neighbour in db.directory_commands(path):
            lines.append("neighbour " + db.normalize(neighbour) + "\n")
    for name in sorted(deps):
        lines.append(f"dep {name} {sha256_file(deps[name])}\n")
    return header + "".join(lines).encode()


def key(db: Database, header: bytes, relpath: str) -> str:
    """The file's key, or "-" when its inputs cannot be listed."""
    try:
        return hashlib.sha256(material(db, header, relpath)).hexdigest()
    except (RuntimeError, OSError) as e:
        print(f"tidy_cache: no key for {relpath}: {e}", file=sys.stderr)
        return "-"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    keys = sub.add_parser("keys", help='print "KEY PATH" per file')
    inputs = sub.add_parser("inputs", help="print what the key of one file hashes")
    compdb = sub.add_parser("compdb", help="write compile_commands.json, unity batches expanded")
    compdb.add_argument("--build-dir", required=True)
    compdb.add_argument("--out", required=True)
    compdb.add_argument(
        "--cuda-out", help="also write CUDA_OUT/compile_commands.json: the .cu entries as clang's"
    )
    for p in (keys, inputs, compdb):
        p.add_argument("--cuda-clang", help="the clang that parses .cu files (with --cuda-shim)")
        p.add_argument("--cuda-shim", help="the folder of the generated CUDA headers")
    for p in (keys, inputs):
        p.add_argument("--build-dir", required=True)
        p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        p.add_argument("--tidy", default="clang-tidy-14", help="the clang-tidy binary")
        p.add_argument("--tidy-args", default="", help="lint.sh's clang-tidy flags besides -p")
    keys.add_argument("--jobs", type=int, default=2)
    keys.add_argument("files", nargs="*")
    inputs.add_argument("file")
    args = parser.parse_args(argv)
    if args.command == "compdb":
        with open(os.path.join(args.build_dir, "compile_commands.json")) as f:
            entries = expand_unity(json.load(f))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compile_commands.json"), "w") as f:
            json.dump(entries, f, indent=1)
        if args.cuda_out:
            if not (args.cuda_clang and args.cuda_shim):
                parser.error("--cuda-out needs --cuda-clang and --cuda-shim")
            write_cuda_shim(args.cuda_shim)
            shim = os.path.realpath(args.cuda_shim)
            os.makedirs(args.cuda_out, exist_ok=True)
            with open(os.path.join(args.cuda_out, "compile_commands.json"), "w") as f:
                json.dump(cuda_entries(entries, args.cuda_clang, shim), f, indent=1)
        return 0

    cuda = (args.cuda_clang, args.cuda_shim) if args.cuda_clang and args.cuda_shim else None
    if cuda:
        write_cuda_shim(args.cuda_shim)  # -MM reads it too (the same bytes every time)
    db = Database(args.root, args.build_dir, cuda)
    with open(os.path.join(db.root, ".clang-tidy"), "rb") as f:
        clang_tidy = f.read()
    header = b"".join(
        [
            FORMAT_TAG,
            f"tidy {tidy_version(args.tidy)}\nargs {args.tidy_args}\n".encode(),
            b".clang-tidy " + hashlib.sha256(clang_tidy).hexdigest().encode() + b"\n",
        ]
    )
    if args.command == "inputs":
        sys.stdout.write(material(db, header, args.file).decode())
        return 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda f: key(db, header, f), args.files))
    for f, k in zip(args.files, results):
        print(k, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
