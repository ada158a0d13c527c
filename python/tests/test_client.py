"""Tests of python/moe_ep_client against real moe-ep-worker processes.

Run by ctest (tests/python.cmake) with /usr/bin/python3, PYTHONPATH holding
the generated stubs and python/, and MOE_EP_WORKER naming the worker binary.
"""

import contextlib
import io
import os
import shutil
import socket
import subprocess
import tempfile
import unittest

import grpc

from moe_ep_client import Group, GroupError, Security
import examples_path  # noqa: F401  (puts python/examples on sys.path)
import form_group

WORKER = os.environ.get("MOE_EP_WORKER", "")


def start_workers(n, extra_args=()):
    procs, targets = [], []
    for _ in range(n):
        p = subprocess.Popen(
            [WORKER, "--listen", "127.0.0.1:0", "--log-level", "warn", *extra_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = p.stdout.readline().strip()
        if not line.startswith("moe-ep-worker listening on "):
            p.kill()
            raise RuntimeError(f"worker did not start: {line!r}")
        procs.append(p)
        targets.append(line.rsplit(" ", 1)[1])
    return procs, targets


def stop_workers(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipUnless(WORKER and os.path.exists(WORKER), "MOE_EP_WORKER not set")
class PlaintextGroupTest(unittest.TestCase):
    def setUp(self):
        self.procs, self.targets = start_workers(2)

    def tearDown(self):
        stop_workers(self.procs)

    def test_example_forms_group_and_agrees_geometry(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = form_group.main(["--targets", ",".join(self.targets), "--tokens", "5,3"])
        text = out.getvalue()
        self.assertEqual(rc, 0, text)
        self.assertIn("formed generation 1 with 2 ranks", text)
        self.assertIn("geometry: epoch 1, counts [5, 3], max 5, R 5", text)
        self.assertEqual(text.count("state=ALLOCATED"), 2)

        with Group(self.targets) as group:
            statuses = group.status()
            self.assertEqual([s.rank for s in statuses], [0, 1])
            self.assertEqual([s.world_size for s in statuses], [2, 2])
            self.assertEqual([s.runtime_max_tokens_per_rank for s in statuses], [5, 5])
            self.assertEqual([s.capacity_tokens for s in statuses], [16, 16])
            self.assertEqual([s.geometry_epoch for s in statuses], [1, 1])
            # Forming again leaves the old group and uses a fresh generation.
            self.assertEqual(group.form(), 2)
            self.assertEqual([s.state for s in group.status()], ["JOINED", "JOINED"])

    def test_geometry_errors(self):
        with Group(self.targets) as group:
            group.form()
            group.configure(hidden_size=64, num_layers=1, num_experts=8, top_k=2)
            ws = group.allocate(hidden_size=64, top_k=2, num_experts=8, capacity_tokens=16)
            # bf16: 2H + 8K bytes per token (DESIGN §5).
            self.assertEqual(ws.dispatch_bytes_per_token, 2 * 64 + 8 * 2)
            self.assertEqual(ws.combine_bytes_per_token, 2 * 64)
            agreed = group.agree_geometry(3, [0, 7])
            self.assertEqual(agreed.token_counts, [0, 7])
            self.assertEqual(agreed.runtime_max_tokens_per_rank, 7)
            with self.assertRaises(ValueError):
                group.agree_geometry(4, [1, 2, 3])
            # R > N (17 > 16) is RESOURCE_EXHAUSTED on every rank; nothing changes.
            with self.assertRaises(GroupError) as caught:
                group.agree_geometry(4, [17, 1])
            self.assertEqual(
                caught.exception.codes, [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
            )
            self.assertIn("rank 0", str(caught.exception))
            self.assertEqual(
                [s.runtime_max_tokens_per_rank for s in group.status()], [7, 7]
            )

    def test_lease_claim_like_the_cli(self):
        """Issue 12: a Group claims the lease (owner id, TTL, take-over)."""
        with Group(self.targets, owner_id="py-owner@a", lease_ttl_s=20.0) as owner:
            owner.form()
            owner.configure(hidden_size=64, num_layers=1, num_experts=8, top_k=2)
            statuses = owner.status()
            self.assertEqual([s.lease_owner for s in statuses], ["py-owner@a"] * 2)
            for s in statuses:
                self.assertGreater(s.lease_remaining_s, 10.0)
                self.assertLessEqual(s.lease_remaining_s, 20.0)
            generation = statuses[0].generation
            # Another owner, and a client that claims nothing: refused on every
            # rank, naming the owner; nothing changes.
            others = [Group(self.targets, owner_id="py-other@b"), Group(self.targets, owner_id="")]
            for other in others:
                with other:
                    with self.assertRaises(GroupError) as caught:
                        other.form()
                    self.assertEqual(
                        caught.exception.codes, [grpc.StatusCode.FAILED_PRECONDITION] * 2
                    )
                    self.assertIn("leased by owner 'py-owner@a'", str(caught.exception))
                    with self.assertRaises(GroupError):
                        other.allocate(
                            hidden_size=64, top_k=2, num_experts=8, capacity_tokens=16
                        )
            self.assertEqual([s.generation for s in owner.status()], [generation] * 2)
            self.assertEqual([s.state for s in owner.status()], ["CONFIGURED"] * 2)
            # The owner goes on; renewing works (seconds left); steps are not leased.
            left = owner.acquire_lease()
            self.assertEqual(len(left), 2)
            for x in left:
                self.assertGreater(x, 10.0)
                self.assertLessEqual(x, 20.0)
            owner.allocate(hidden_size=64, top_k=2, num_experts=8, capacity_tokens=16)
            with Group(self.targets, owner_id="") as stepper:
                agreed = stepper.agree_geometry(1, [3, 4])
                self.assertEqual(agreed.runtime_max_tokens_per_rank, 4)
            # An explicit take-over: the new owner forms, the old one is refused.
            with Group(self.targets, owner_id="py-new@c", take_over=True) as new_owner:
                self.assertGreater(new_owner.form(), generation)
                self.assertEqual([s.lease_owner for s in new_owner.status()], ["py-new@c"] * 2)
                with self.assertRaises(GroupError) as caught:
                    owner.configure(hidden_size=64, num_layers=1, num_experts=8, top_k=2)
                self.assertIn("leased by owner 'py-new@c'", str(caught.exception))
                new_owner.release_lease()
                self.assertEqual([s.lease_owner for s in new_owner.status()], ["", ""])
        with self.assertRaises(ValueError) as caught:
            Group(self.targets, lease_ttl_s=-1)
        self.assertIn("lease_ttl_s: expected in [0, 3600] seconds, got -1", str(caught.exception))
        with self.assertRaises(ValueError):
            Group(self.targets, group_timeout_s=0)
        with self.assertRaises(ValueError):
            Group(self.targets, owner_id="x" * 129)

    def test_dispatch_dtypes_are_what_the_worker_moves(self):
        """Issue 31 item 4: Group.allocate offers the proto's DispatchDType
        values the worker accepts, and only those."""
        import moe_ep_client
        from moe_ep.v1 import worker_pb2
        from moe_ep_client import client

        self.assertEqual(moe_ep_client.DISPATCH_DTYPES, ("bf16", "fp8_e4m3"))
        # Every value of the enum is either offered or known refused, so a
        # value added to worker.proto fails here until it is classified.
        names = {v.name[len("DISPATCH_DTYPE_"):].lower()
                 for v in worker_pb2.DispatchDType.DESCRIPTOR.values if v.number != 0}
        self.assertEqual(names, set(moe_ep_client.DISPATCH_DTYPES) | client._REFUSED_DTYPES)
        H = 128  # fp8_e4m3 needs a multiple of its 128-value scale block
        with Group(self.targets) as group:
            group.form()
            group.configure(hidden_size=H, num_layers=1, num_experts=8, top_k=2)
            for dtype in moe_ep_client.DISPATCH_DTYPES:
                ws = group.allocate(hidden_size=H, top_k=2, num_experts=8, capacity_tokens=4,
                                    dtype=dtype)
                # DESIGN §5: bf16 2H + 8K; e4m3 H + 4 * H / 128 (scales) + 8K.
                want = {"bf16": 2 * H + 8 * 2, "fp8_e4m3": H + 4 * (H // 128) + 8 * 2}[dtype]
                self.assertEqual(ws.dispatch_bytes_per_token, want, dtype)
            for dtype in sorted(client._REFUSED_DTYPES):
                with self.assertRaises(ValueError) as caught:
                    group.allocate(hidden_size=H, top_k=2, num_experts=8, capacity_tokens=4,
                                   dtype=dtype)
                self.assertIn("dtype: expected one of ['bf16', 'fp8_e4m3']", str(caught.exception))
                # ... and the worker itself refuses them.
                request = worker_pb2.AllocateWorkspaceRequest(
                    hidden_size=H, top_k=2, num_experts=8, capacity_tokens=4,
                    dispatch_dtype=getattr(worker_pb2, "DISPATCH_DTYPE_" + dtype.upper()),
                    lease=group.claim())
                with self.assertRaises(GroupError) as caught:
                    group._fan_out("AllocateWorkspace",
                                   lambda r, s, t: s.AllocateWorkspace.future(request, timeout=t))
                self.assertEqual(caught.exception.codes, [grpc.StatusCode.INVALID_ARGUMENT] * 2)
                self.assertIn(f"got {dtype}", str(caught.exception))

    def test_version_is_the_project_version(self):
        import re
        from importlib import metadata

        import moe_ep_client

        cmake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "CMakeLists.txt")
        with open(cmake) as f:
            want = re.search(r"project\(\s*moe_ep\s+VERSION\s+([0-9.]+)", f.read()).group(1)
        self.assertEqual(moe_ep_client.__version__, want)
        self.assertEqual(metadata.version("moe-ep-client"), want)  # what pip installed

    def test_unreachable_worker_is_named(self):
        dead = f"127.0.0.1:{free_port()}"
        with Group([self.targets[0], dead], timeout_s=2.0) as group:
            with self.assertRaises(GroupError) as caught:
                group.status()
            failures = caught.exception.failures
            self.assertEqual([f.rank for f in failures], [1])
            self.assertEqual(failures[0].target, dead)
            self.assertIn(
                failures[0].code,
                (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
            )
            each = group.status_each()
            self.assertEqual(each[0].state, "STARTED")
            self.assertEqual(each[1].rank, 1)

    def test_security_options_are_checked(self):
        with self.assertRaises(ValueError):
            Security(token="t").channel_credentials()
        with self.assertRaises(ValueError):
            Security(tls_ca="ca.crt", tls_cert="c.crt").channel_credentials()
        with self.assertRaises(ValueError):
            Group(["127.0.0.1:1", "127.0.0.1:1"])


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@unittest.skipUnless(WORKER and os.path.exists(WORKER), "MOE_EP_WORKER not set")
@unittest.skipUnless(shutil.which("openssl"), "openssl not installed")
class MutualTlsGroupTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="moe-ep-py-tls-")
        d = lambda name: os.path.join(self.dir, name)  # noqa: E731
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        openssl("req", "-x509", *key, "-keyout", d("ca.key"), "-out", d("ca.crt"),
                "-days", "1", "-subj", "/CN=test-ca")
        with open(d("leaf.ext"), "w") as f:
            f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                    "extendedKeyUsage=serverAuth,clientAuth\n")
        for leaf in ("server", "client"):
            openssl("req", *key, "-keyout", d(leaf + ".key"), "-out", d(leaf + ".csr"),
                    "-subj", "/CN=" + leaf)
            openssl("x509", "-req", "-in", d(leaf + ".csr"), "-CA", d("ca.crt"), "-CAkey",
                    d("ca.key"), "-CAcreateserial", "-days", "1", "-out", d(leaf + ".crt"),
                    "-extfile", d("leaf.ext"))
        with open(d("token"), "w") as f:
            f.write("py-token\n")
        self.d = d
        self.procs, self.targets = start_workers(
            2,
            ["--tls-cert", d("server.crt"), "--tls-key", d("server.key"),
             "--tls-client-ca", d("ca.crt"), "--auth-token-file", d("token")],
        )

    def tearDown(self):
        stop_workers(self.procs)
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_example_over_mutual_tls_with_token(self):
        d = self.d
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = form_group.main([
                "--targets", ",".join(self.targets), "--tls-ca", d("ca.crt"),
                "--tls-cert", d("client.crt"), "--tls-key", d("client.key"),
                "--auth-token-file", d("token"), "--tokens", "2,9",
            ])
        self.assertEqual(rc, 0, out.getvalue())
        self.assertIn("counts [2, 9], max 9, R 9", out.getvalue())

    def test_missing_token_or_certificate_is_refused(self):
        d = self.d
        no_token = Security(tls_ca=d("ca.crt"), tls_cert=d("client.crt"), tls_key=d("client.key"))
        with Group(self.targets, security=no_token, timeout_s=5) as group:
            with self.assertRaises(GroupError) as caught:
                group.form()
            self.assertEqual(caught.exception.codes, [grpc.StatusCode.UNAUTHENTICATED] * 2)
        no_cert = Security(tls_ca=d("ca.crt"), token="py-token")
        with Group(self.targets, security=no_cert, timeout_s=5) as group:
            with self.assertRaises(GroupError) as caught:
                group.status()
            self.assertEqual(caught.exception.codes, [grpc.StatusCode.UNAVAILABLE] * 2)
        good = Security(d("ca.crt"), d("client.crt"), d("client.key"), "py-token")
        with Group(self.targets, security=good) as group:
            statuses = group.status()
            self.assertEqual([s.state for s in statuses], ["STARTED", "STARTED"])
            self.assertEqual([s.errors for s in statuses], [0, 0])


if __name__ == "__main__":
    unittest.main()
