"""moe_ep_client.engine (the embedded worker over libmoe_ep.so, issue 16):
argument checks that name the argument before any call, library errors, and
one rank in this process formed remotely by `moe-ep up --targets`, checked
against a NumPy reference.

Run by ctest (tests/embedded.cmake: embedded_python_engine) with
MOE_EP_LIBRARY and MOE_EP_CLI set; without MOE_EP_LIBRARY (the python_client
venv run) the tests skip, saying so.
"""

import os
import subprocess
import unittest

import numpy as np

LIBRARY = os.environ.get("MOE_EP_LIBRARY")
CLI = os.environ.get("MOE_EP_CLI")


@unittest.skipUnless(LIBRARY, "MOE_EP_LIBRARY is not set (tests/embedded.cmake sets it)")
class ArgumentChecksTest(unittest.TestCase):
    def test_each_check_names_the_argument(self):
        from moe_ep_client.engine import _buffer

        ok = np.zeros((3, 2), np.int32)
        self.assertEqual(_buffer("topk_ids", ok, "int32", (3, 2), False).shape, (3, 2))
        cases = [
            (np.zeros((3, 2), np.int64), (3, 2), TypeError, "topk_ids: expected dtype int32, got int64"),
            (np.zeros((3, 3), np.int32), (3, 2), ValueError, "topk_ids: expected shape [3, 2], got [3, 3]"),
            (np.zeros((4, 3), np.int32)[:, :2], (None, 2), ValueError, "topk_ids: must be C-contiguous"),
            ([[1, 2]], (1, 2), TypeError, "topk_ids: expected a NumPy array or a torch tensor, got list"),
        ]
        for value, shape, error, text in cases:
            with self.assertRaises(error) as caught:
                _buffer("topk_ids", value, "int32", shape, False)
            self.assertIn(text, str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            _buffer("hidden_states", np.zeros((1, 4), np.uint16), "bf16", (None, 4), True)
        self.assertIn("hidden_states: expected a CUDA torch tensor", str(caught.exception))
        with self.assertRaises(TypeError) as caught:
            _buffer("hidden_states", np.zeros((1, 4), np.float32), "bf16", (None, 4), False)
        self.assertIn("uint16 (bf16 bit patterns)", str(caught.exception))

    def test_the_torch_fast_path_accepts_only_what_the_full_checks_accept(self):
        # A stand-in for torch.Tensor (no torch here): the one-pass check of a
        # CUDA engine's arguments (issue 30 item 3) takes exact tensors of the
        # right dtype, shape, device and layout, and leaves anything else to
        # _buffer, which names the argument.
        from types import SimpleNamespace
        from unittest import mock

        from moe_ep_client import engine

        class Tensor:
            def __init__(self, dtype, shape, device=0, contiguous=True, ptr=4096):
                self.dtype, self.shape = dtype, shape
                self._device, self._contiguous, self._ptr = device, contiguous, ptr

            def get_device(self):
                return self._device

            def is_contiguous(self):
                return self._contiguous

            def data_ptr(self):
                return self._ptr

        class Sub(Tensor):
            pass

        bf16, i32, f32 = object(), object(), object()
        dtypes = {"bf16": bf16, "int32": i32, "float32": f32}
        info = SimpleNamespace(device=1, hidden=8, top_k=2)
        with mock.patch.object(engine, "_TORCH_TYPES", [Tensor]), \
                mock.patch.object(engine, "_TORCH_DTYPE_OBJECTS", dtypes):
            def args(**change):
                a = {"h": Tensor(bf16, (3, 8), 1, ptr=1000), "ids": Tensor(i32, (3, 2), 1, ptr=2000),
                     "w": Tensor(f32, (3, 2), 1, ptr=3000)}
                a.update(change)
                return a["h"], a["ids"], a["w"]

            h, ids, w = engine._torch_inputs(*args(), info)
            self.assertEqual((h.ptr, h.shape, h.torch, h.cuda, h.device, ids, w),
                             (1000, (3, 8), True, True, 1, 2000, 3000))
            empty = engine._torch_inputs(Tensor(bf16, (0, 8), 1, ptr=0), Tensor(i32, (0, 2), 1, ptr=0),
                                         Tensor(f32, (0, 2), 1, ptr=0), info)
            self.assertEqual((empty[0].ptr, empty[0].shape, empty[1], empty[2]), (None, (0, 8), None, None))
            for change in ({"h": Sub(bf16, (3, 8), 1)}, {"ids": Tensor(f32, (3, 2), 1)},
                           {"w": Tensor(bf16, (3, 2), 1)}, {"h": Tensor(bf16, (3, 9), 1)},
                           {"h": Tensor(bf16, (3, 8, 1), 1)}, {"ids": Tensor(i32, (4, 2), 1)},
                           {"w": Tensor(f32, (3, 3), 1)}, {"h": Tensor(bf16, (3, 8), 0)},
                           {"ids": Tensor(i32, (3, 2), -1)}, {"w": Tensor(f32, (3, 2), 1, False)}):
                self.assertIsNone(engine._torch_inputs(*args(**change), info), change)
            self.assertIsNone(engine._torch_inputs(*args(), SimpleNamespace(device=-1, hidden=8, top_k=2)))
            out = Tensor(bf16, (2, 3, 8), 1, ptr=5000)
            self.assertEqual(engine._torch_address(out, "bf16", (2, 3, 8), 1), 5000)
            self.assertIsNone(engine._torch_address(Tensor(bf16, (2, 0, 8), 1, ptr=0), "bf16", (2, 0, 8), 1))
            for x, shape, device in ((out, (2, 3, 9), 1), (out, (2, 3, 8), 0), (out, (2, 3, 8), -1),
                                     (Sub(bf16, (2, 3, 8), 1), (2, 3, 8), 1),
                                     (Tensor(f32, (2, 3, 8), 1), (2, 3, 8), 1),
                                     (Tensor(bf16, (2, 3, 8), 1, False), (2, 3, 8), 1)):
                self.assertIs(engine._torch_address(x, "bf16", shape, device), False)
        with mock.patch.object(engine, "_TORCH_TYPES", []):  # torch not seen yet
            self.assertIsNone(engine._torch_inputs(*args(), info))
            self.assertIs(engine._torch_address(out, "bf16", (2, 3, 8), 1), False)

    def test_timeouts_are_seconds_and_never_round_to_no_limit(self):
        from moe_ep_client.engine import _timeout_ms

        self.assertEqual([_timeout_ms(v) for v in (0, 0.0, 1e-9, 0.0015, 2)], [0, 0, 1, 1, 2000])
        for bad in ("1", -1, -0.5, True, None, float("nan")):
            with self.assertRaises(ValueError) as caught:
                _timeout_ms(bad)
            self.assertIn("timeout_s: expected seconds >= 0", str(caught.exception))

    def test_stop_waits_for_a_call_running_on_another_thread(self):
        import threading
        import time

        from moe_ep_client.engine import EngineError, Worker

        worker = Worker(["--listen=127.0.0.1:0", "--backend=gloo", "--log-level=warn"])
        ended = {}

        def waiting():
            try:
                worker.wait_ready(timeout_s=1.5)  # never formed: DEADLINE_EXCEEDED at 1.5 s
            except EngineError as e:
                ended["code"] = e.code
            ended["at"] = time.monotonic()

        t = threading.Thread(target=waiting)
        t.start()
        time.sleep(0.3)
        worker.stop()  # must not free the worker under the running call
        stopped_at = time.monotonic()
        t.join()
        self.assertEqual(ended.get("code"), "DEADLINE_EXCEEDED")
        self.assertGreaterEqual(stopped_at, ended["at"])
        with self.assertRaises(ValueError) as caught:
            worker.info()
        self.assertIn("worker: stopped", str(caught.exception))

    def test_bf16_conversion_rounds_to_nearest_even(self):
        from moe_ep_client.engine import bf16_to_float32, float32_to_bf16

        bits = float32_to_bf16(np.array([1.0, -2.0, 1.00390625, 1.01171875, 3.140625], np.float32))
        self.assertEqual(bits.tolist(), [0x3F80, 0xC000, 0x3F80, 0x3F82, 0x4049])
        self.assertEqual(bf16_to_float32(bits).tolist(), [1.0, -2.0, 1.0, 1.015625, 3.140625])

    def test_library_errors_carry_code_and_message(self):
        from moe_ep_client.engine import EngineError, Worker, version

        self.assertRegex(version(), r"^\d+\.\d+\.\d+$")
        with self.assertRaises(EngineError) as caught:
            Worker(["--no-such-flag"])
        self.assertEqual(caught.exception.code, "INVALID_ARGUMENT")
        self.assertIn("--no-such-flag", caught.exception.message)
        with Worker(["--listen=127.0.0.1:0", "--backend=gloo", "--log-level=warn"]) as worker:
            with self.assertRaises(EngineError) as caught:
                worker.wait_ready(timeout_s=0.05)
            self.assertEqual(caught.exception.code, "DEADLINE_EXCEEDED")
            with self.assertRaises(EngineError) as caught:
                worker.info()
            self.assertEqual(caught.exception.code, "FAILED_PRECONDITION")
            # A data call before the group exists names itself and the wait.
            with self.assertRaises(EngineError) as caught:
                worker.sync_token_counts(1)
            self.assertEqual((caught.exception.call, caught.exception.code),
                             ("moe_ep_sync_token_counts", "FAILED_PRECONDITION"))
            self.assertIn("wait_ready()", caught.exception.message)
        with self.assertRaises(ValueError):
            worker.noop()  # stopped


@unittest.skipUnless(LIBRARY and CLI, "MOE_EP_LIBRARY / MOE_EP_CLI are not set")
class OneRankTest(unittest.TestCase):
    """EP 1 in this process: `moe-ep up --targets` configures it remotely."""

    def test_dispatch_combine_and_forward_match_numpy(self):
        from moe_ep_client.engine import Dispatcher, EngineError, Worker, bf16_to_float32, float32_to_bf16

        with Worker(["--listen=127.0.0.1:0", "--backend=gloo", "--log-level=warn"]) as worker:
            up = subprocess.run(
                [CLI, "up", "--targets", worker.address, "--backend", "gloo", "--hidden", "8",
                 "--num-experts", "4", "--top-k", "2", "--capacity", "16", "--cuda-graph-buckets",
                 "4,8,16", "--load-experts", "identity"],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(up.returncode, 0, up.stdout + up.stderr)
            self.assertIn("1 running workers formed", up.stdout)
            worker.wait_ready(timeout_s=10)
            info = worker.info()
            self.assertEqual((info.rank, info.world_size, info.hidden, info.top_k), (0, 1, 8, 2))
            self.assertEqual((info.first_expert, info.num_local_experts, info.backend), (0, 4, "gloo"))

            rng = np.random.default_rng(7)
            x = float32_to_bf16(rng.standard_normal((5, 8)).astype(np.float32))
            ids = np.array([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]], np.int32)
            w = rng.random((5, 2)).astype(np.float32)
            d = Dispatcher(worker)
            out = d.dispatch(x, ids, w)
            # 5 tokens, R = the bucket 8: one source row of 8 slots, 3 of padding.
            self.assertEqual(out.hidden_states.shape, (1, 8, 8))
            self.assertEqual(out.num_recv_tokens_per_source.tolist(), [5])
            self.assertEqual(out.num_recv_tokens_per_expert.tolist(), [3, 2, 3, 2])
            np.testing.assert_array_equal(out.hidden_states[0, :5], x)
            np.testing.assert_array_equal(out.topk_ids[0, :5], ids)
            np.testing.assert_array_equal(out.topk_ids[0, 5:], np.full((3, 2), -1))
            self.assertTrue((out.hidden_states[0, 5:] == 0).all())
            # A second dispatch before combine is refused, naming combine.
            with self.assertRaises(EngineError) as caught:
                worker.dispatch(x, ids, w, recv_rows=8)
            self.assertEqual(caught.exception.code, "FAILED_PRECONDITION")
            # Experts: expert e scales by (e + 1).
            xf = bf16_to_float32(out.hidden_states)
            scale = (out.topk_weights * (out.topk_ids + 1) * (out.topk_ids >= 0)).sum(axis=2)
            y = d.combine(float32_to_bf16(xf * scale[:, :, None]))
            ref = bf16_to_float32(x) * (w * (ids + 1)).sum(axis=1)[:, None]
            np.testing.assert_allclose(bf16_to_float32(y), ref, rtol=2**-7, atol=1e-6)
            # A combine with no step dispatched goes to the library, which
            # names the order (not a shape check against the last step).
            for out_arg in (None, np.zeros((5, 8), np.uint16)):  # out= changes nothing here
                with self.assertRaises(EngineError) as caught:
                    worker.combine(np.zeros((1, 3, 8), np.uint16), out=out_arg)
                self.assertEqual(caught.exception.code, "FAILED_PRECONDITION")
                self.assertIn("combine needs a dispatch first", str(caught.exception))
            # dispatch(out=) writes the same arrays again; another R is refused.
            worker.commit_geometry(50, 8, 5)
            again = worker.dispatch(x[::-1].copy(), ids[::-1].copy(), w[::-1].copy(),
                                    recv_rows=8, out=out)
            self.assertIs(again, out)
            np.testing.assert_array_equal(out.hidden_states[0, :5], x[::-1])
            # combine(out=): a wrong shape is refused naming `out` (the step
            # stays dispatched), then the result lands in the caller's array.
            with self.assertRaises(ValueError) as caught:
                worker.combine(np.zeros((1, 8, 8), np.uint16), out=np.zeros((4, 8), np.uint16))
            self.assertIn("out: expected shape [5, 8], got [4, 8]", str(caught.exception))
            read_only = np.zeros((5, 8), np.uint16)
            read_only.flags.writeable = False
            with self.assertRaises(ValueError) as caught:
                worker.combine(np.zeros((1, 8, 8), np.uint16), out=read_only)
            self.assertIn("out: must be writeable", str(caught.exception))
            xf = bf16_to_float32(out.hidden_states)
            scale = (out.topk_weights * (out.topk_ids + 1) * (out.topk_ids >= 0)).sum(axis=2)
            y_out = np.full((5, 8), 0x7FC0, np.uint16)  # NaN until written
            got = worker.combine(float32_to_bf16(xf * scale[:, :, None]), out=y_out)
            self.assertIs(got, y_out)
            ref = bf16_to_float32(x[::-1]) * (w[::-1] * (ids[::-1] + 1)).sum(axis=1)[:, None]
            np.testing.assert_allclose(bf16_to_float32(y_out), ref, rtol=2**-7, atol=1e-6)
            # Combine in place: out a view of the expert outputs' own rows (an
            # engine reusing the buffer, as the GPU planes' steady-state test
            # does); every row is read before one is written, so the result
            # is the same bits as into a fresh array. Token 0 routes nowhere,
            # so token t's row sits in slot t - 1 and output row t overwrites
            # token t + 1's input: a plane writing before it read all would
            # show.
            shifted = ids.copy()
            shifted[0] = -1
            worker.dispatch(x, shifted, w, recv_rows=8, out=out)
            self.assertEqual(out.num_recv_tokens_per_source.tolist(), [4])
            xf = bf16_to_float32(out.hidden_states)
            scale = (out.topk_weights * (out.topk_ids + 1) * (out.topk_ids >= 0)).sum(axis=2)
            expert_out = float32_to_bf16(xf * scale[:, :, None])
            fresh = worker.combine(expert_out.copy())
            worker.dispatch(x, shifted, w, recv_rows=8, out=out)
            alias = expert_out[0, :5]
            self.assertIs(worker.combine(expert_out, out=alias), alias)
            np.testing.assert_array_equal(alias, fresh)
            ref = bf16_to_float32(x) * (w * (shifted + 1) * (shifted >= 0)).sum(axis=1)[:, None]
            self.assertTrue((alias[0] == 0).all())  # a token routed nowhere sums nothing
            np.testing.assert_allclose(bf16_to_float32(alias), ref, rtol=2**-7, atol=1e-6)
            worker.commit_geometry(51, 16, 5)
            with self.assertRaises(ValueError) as caught:
                worker.dispatch(x, ids, w, recv_rows=16, out=out)
            self.assertIn("out: expected a DispatchOutput of a dispatch with recv_rows 16",
                          str(caught.exception))
            # forward with the worker's identity experts: sum_k w_k x.
            counts, r = worker.sync_token_counts(5)
            self.assertEqual((counts, r), ([5], 8))
            worker.commit_geometry(100, r, 5)
            f = worker.forward(0, x, ids, w)
            np.testing.assert_allclose(bf16_to_float32(f), bf16_to_float32(x) * w.sum(axis=1)[:, None],
                                       rtol=2**-7, atol=1e-6)
            # Bad input is refused before any call, naming the argument.
            with self.assertRaises(ValueError) as caught:
                d.dispatch(x[:, :4].copy(), ids, w)
            self.assertIn("hidden_states: expected shape [*, 8], got [5, 4]", str(caught.exception))
            with self.assertRaises(TypeError) as caught:
                d.dispatch(x, ids.astype(np.int64), w)
            self.assertIn("topk_ids: expected dtype int32", str(caught.exception))
            # The GPU-only and graph calls on the CPU backend: the device
            # token agreement is UNIMPLEMENTED naming the host call; the
            # sync point has nothing to wait for; the graph token is this
            # workspace's, any other one says RECAPTURE.
            status = worker._lib.moe_ep_sync_token_counts_async(worker._handle, None, None,
                                                                None, 0)
            self.assertEqual(status, 12)  # MOE_EP_UNIMPLEMENTED
            self.assertIn(b"use moe_ep_sync_token_counts", worker._lib.moe_ep_last_error())
            worker.check_step()
            token = worker.graph_token()
            self.assertGreater(token, 0)
            self.assertTrue(worker.check_graph(token))
            self.assertFalse(worker.check_graph(token + 1))
            # Receive buffers live in the one-sided plane's windows only.
            with self.assertRaises(EngineError) as caught:
                worker.receive_buffers()
            self.assertEqual((caught.exception.call, caught.exception.code),
                             ("moe_ep_receive_buffers", "UNIMPLEMENTED"))
            self.assertIn("the gloo data plane has no receive buffers", caught.exception.message)


if __name__ == "__main__":
    unittest.main()
