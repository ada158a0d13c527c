"""Tests of moe_ep_client.Coordinator (a client of `moe-ep coordinator`) and of
Group.close() giving the lease back (issue 31 items 1 and 2), against real
moe-ep-worker processes and a real `moe-ep coordinator`.

MOE_EP_WORKER names the worker binary; MOE_EP_CLI the moe-ep binary (default:
BUILD/client/moe-ep next to BUILD/server/moe-ep-worker).
"""

import os
import subprocess
import unittest

from moe_ep_client import Coordinator, CoordinatorError, Group
from moe_ep_client.coordinator import desired_state

import grpc

WORKER = os.environ.get("MOE_EP_WORKER", "")
CLI = os.environ.get("MOE_EP_CLI") or (
    os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(WORKER))), "client", "moe-ep")
    if WORKER
    else ""
)


def start(argv, ready):
    """Starts argv; returns (process, the last word of its first stdout line with `ready`)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        if ready in line:
            return p, line.strip().rsplit(" ", 1)[1]
    p.kill()
    raise RuntimeError(f"{argv[0]} did not print {ready!r}")


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()


def start_workers(n):
    procs, targets = [], []
    for _ in range(n):
        p, target = start([WORKER, "--listen", "127.0.0.1:0", "--log-level", "warn"],
                          "moe-ep-worker listening on ")
        procs.append(p)
        targets.append(target)
    return procs, targets


@unittest.skipUnless(WORKER and os.path.exists(WORKER) and CLI and os.path.exists(CLI),
                     "MOE_EP_WORKER / moe-ep not found")
class CoordinatorTest(unittest.TestCase):
    def setUp(self):
        self.procs, self.targets = start_workers(2)
        coordinator, self.address = start(
            [CLI, "coordinator", "--listen", "127.0.0.1:0", "--owner", "python@coordinator",
             "--probe-interval-ms", "100", "--log-level", "warn"],
            "moe-ep coordinator listening on ",
        )
        self.procs.append(coordinator)

    def tearDown(self):
        stop(self.procs)

    def state(self, **extra):
        return {"targets": self.targets, "backend": "gloo", "model": "tiny-moe", "layers": 1,
                "capacity_tokens": 16, "experts": {"kind": "EXPERT_KIND_IDENTITY"}, **extra}

    def test_apply_wait_ready_and_drain(self):
        with Coordinator(self.address) as c:
            view = c.group()
            self.assertEqual(view.phase, "UNSPECIFIED")
            self.assertEqual(view.ranks, [])
            applied = c.apply(self.state())
            self.assertEqual((applied.desired_version, applied.changed), (1, True))
            self.assertEqual(c.apply(self.state()).changed, False)  # idempotent
            view = c.wait_ready(timeout_s=60)
            self.assertTrue(view.ready)
            self.assertEqual(view.generation, 1)
            self.assertEqual([r.state for r in view.ranks], ["READY", "READY"])
            self.assertEqual([r.worker_state for r in view.ranks], ["ALLOCATED", "ALLOCATED"])
            self.assertEqual([r.target for r in view.ranks], self.targets)
            self.assertEqual(view.desired["capacity_tokens"], "16")  # int64: a JSON string
            self.assertIn("formed", [e.kind for e in view.history])
            self.assertGreater(view.history[-1].time_unix_s, 1.7e9)  # seconds, not ms
            with Group(self.targets, owner_id="") as g:
                self.assertEqual([s.lease_owner for s in g.status()],
                                 ["python@coordinator"] * 2)

            with self.assertRaises(CoordinatorError) as refused:
                c.apply(self.state(layers=-1))
            self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("layers", refused.exception.details)

            self.assertEqual(c.drain(), [])
            self.assertEqual(c.group().phase, "DRAINED")
            with Group(self.targets, owner_id="") as g:
                statuses = g.status()
            self.assertEqual([s.state for s in statuses], ["STARTED", "STARTED"])
            self.assertEqual([s.lease_owner for s in statuses], ["", ""])  # given back

    def test_a_worker_is_no_coordinator_and_bad_states_name_the_field(self):
        with Coordinator(self.targets[0]) as c:
            with self.assertRaises(CoordinatorError) as e:
                c.group()
            self.assertEqual(e.exception.code, grpc.StatusCode.UNIMPLEMENTED)
            self.assertIn("serves no moe_ep.v1.Coordinator", str(e.exception))
        with self.assertRaises(ValueError) as bad:
            desired_state({"targets": self.targets, "no_such_field": 1})
        self.assertIn("no_such_field", str(bad.exception))
        with self.assertRaises(ValueError):
            Coordinator("")


@unittest.skipUnless(WORKER and os.path.exists(WORKER), "MOE_EP_WORKER not set")
class GroupLeaseTest(unittest.TestCase):
    def setUp(self):
        self.procs, self.targets = start_workers(2)

    def tearDown(self):
        stop(self.procs)

    def test_close_gives_the_lease_back_at_once(self):
        with Group(self.targets, backend="gloo", owner_id="python@owner") as g:
            g.form()
            self.assertEqual([s.lease_owner for s in g.status()], ["python@owner"] * 2)
        # Not held for the 30 s of its TTL after __exit__.
        with Group(self.targets, owner_id="") as other:
            self.assertEqual([s.lease_owner for s in other.status()], ["", ""])
            self.assertEqual([s.state for s in other.status()], ["JOINED", "JOINED"])
        # close() is idempotent, and a Group that holds nothing releases nothing.
        g.close()
        with Group(self.targets, owner_id="python@other") as idle:
            idle.status()


if __name__ == "__main__":
    unittest.main()
