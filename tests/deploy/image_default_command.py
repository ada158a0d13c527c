#!/usr/bin/env python3
"""Runs a container image's default command on the built binaries (issue 9 item 2).

    image_default_command.py DOCKERFILE BUILD_DIR

No image can be built here (no container engine), so this reads the runtime
stage's ENTRYPOINT and CMD (exec form, JSON) from DOCKERFILE, maps the program
(/usr/local/bin/moe-ep-worker in the image) to BUILD_DIR/server/moe-ep-worker,
and runs that argv as a bare `docker run IMAGE` would. It must start (print
"moe-ep-worker listening on HOST:PORT" with the --listen address), answer
grpc.health.v1.Health/Check on its --health-listen port (else on --listen),
answer GetStatus
on its control plane (`moe-ep status`, state STARTED), and exit 0 on SIGTERM.

The image's ports are fixed (50051, 8081) and it may bind 0.0.0.0, so the run
happens in a network namespace of its own (unshare -n; only its loopback is
up): no port conflicts with other tests, nothing reachable from outside.
Exit status: 0 pass, 1 fail, 77 skipped (no network namespace here).
"""

import json
import os
import signal
import subprocess
import sys
from typing import List, Optional

import grpc

SKIP = 77
# HealthCheckResponse.status (grpc/health/v1/health.proto): field 1, varint.
HEALTH_STATUS = {b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}


def image_argv(dockerfile: str) -> List[str]:
    """ENTRYPOINT + CMD of the last stage, both required in exec (JSON) form."""
    with open(dockerfile) as f:
        lines = f.read().splitlines()
    last_from = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    found = {}
    for line in lines[last_from:]:
        word, _, rest = line.partition(" ")
        if word.upper() in ("ENTRYPOINT", "CMD"):
            try:
                value = json.loads(rest)
            except json.JSONDecodeError as e:
                raise SystemExit(f"FAIL {dockerfile}: {word} is not in exec form (JSON): {e}")
            if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise SystemExit(f"FAIL {dockerfile}: {word} is not a JSON list of strings")
            found[word.upper()] = value
    if "ENTRYPOINT" not in found:
        raise SystemExit(f"FAIL {dockerfile}: the runtime stage has no ENTRYPOINT")
    return found["ENTRYPOINT"] + found.get("CMD", [])


def flag_value(argv: List[str], name: str) -> Optional[str]:
    """The value of --name (kebab or the old underscore spelling), or None."""
    names = {f"--{name}", "--" + name.replace("-", "_")}
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def loopback(address: str) -> str:
    """host:port -> 127.0.0.1:port for a wildcard host (we call from inside)."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "") else address


def check(dockerfile: str, build_dir: str) -> int:
    argv = image_argv(dockerfile)
    program = os.path.basename(argv[0])
    if program != "moe-ep-worker":
        print(f"FAIL {dockerfile}: the default command runs {argv[0]}, expected moe-ep-worker")
        return 1
    argv = [os.path.join(build_dir, "server", "moe-ep-worker")] + argv[1:]
    print("default command:", " ".join([program] + argv[1:]))
    listen = flag_value(argv, "listen") or "127.0.0.1:0"
    # Probes use the plaintext health port when there is one, else --listen.
    health = flag_value(argv, "health-listen") or listen

    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    try:
        line = worker.stdout.readline().strip()
        if not line.startswith("moe-ep-worker listening on "):
            worker.wait(timeout=30)
            print(f"FAIL the worker did not start (exit status {worker.returncode}): {line!r}")
            return 1
        bound = line.rsplit(" ", 1)[1]
        print(line)
        if bound != listen:
            print(f"FAIL it listens on {bound}, the command says --listen={listen}")
            return 1

        if health == listen:
            health = bound  # port 0 resolved
        with grpc.insecure_channel(loopback(health)) as channel:
            check_rpc = channel.unary_unary("/grpc.health.v1.Health/Check")
            reply = check_rpc(b"", timeout=30)  # HealthCheckRequest{service: ""}
        status = HEALTH_STATUS.get(reply)
        if status is None:
            print(f"FAIL health Check on {health} answered {reply!r}")
            return 1
        print(f"health Check on {health}: OK, {status}")

        cli = os.path.join(build_dir, "client", "moe-ep")
        table = subprocess.run([cli, "status", "--targets", loopback(bound)],
                               capture_output=True, text=True, timeout=60)
        print(table.stdout, end="")
        if table.returncode != 0 or "STARTED" not in table.stdout:
            print(f"FAIL moe-ep status exited {table.returncode}: {table.stderr}")
            return 1

        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
        if code != 0:
            print(f"FAIL the worker exited {code} on SIGTERM, expected 0")
            return 1
        print("SIGTERM: exit status 0")
        return 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    if os.environ.get("MOE_EP_IN_NETNS") != "1":
        probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            print(f"SKIP: cannot create a network namespace (unshare -n): {probe.stderr.strip()}")
            return SKIP
        env = dict(os.environ, MOE_EP_IN_NETNS="1")
        script = 'ip link set lo up && exec "$@"'
        return subprocess.run(["unshare", "-n", "sh", "-c", script, "sh", sys.executable,
                               os.path.abspath(__file__), *sys.argv[1:]], env=env).returncode
    rc = check(sys.argv[1], sys.argv[2])
    print("PASS" if rc == 0 else "FAILED")
    return rc


if __name__ == "__main__":
    sys.exit(main())
