"""Data-plane calls of python/moe_ep_client (LoadExperts, Forward, Benchmark)
against two real moe-ep-worker processes, and the tensor encoding.

Run by ctest (tests/python.cmake) like test_client.py.
"""

import os
import struct
import unittest

import grpc
import numpy as np

from moe_ep.v1 import tensor_pb2
from moe_ep_client import ForwardInput, Group, GroupError, tensors
from test_client import WORKER, start_workers, stop_workers


class TensorEncodingTest(unittest.TestCase):
    def test_bf16_rounds_to_nearest_even(self):
        t = tensors.bf16_tensor([[1.0, -2.0, 1.00390625, 1.01171875, 3.140625]], 5)
        self.assertEqual(list(t.shape), [1, 5])
        bits = struct.unpack("<5H", t.data)
        # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: even (1.0); 1 + 3 * 2^-8
        # is halfway between 1 + 2^-7 and 1 + 2^-6: even (1 + 2^-6).
        self.assertEqual(bits, (0x3F80, 0xC000, 0x3F80, 0x3F82, 0x4049))
        self.assertEqual(tensors.to_rows(t), [[1.0, -2.0, 1.0, 1.015625, 3.140625]])

    def test_fp32_and_int32_round_trip(self):
        f = tensors.fp32_tensor([[0.1, 2.5], [-1.0, 0.0]], 2)
        self.assertEqual(f.dtype, tensor_pb2.DTYPE_FP32)
        self.assertEqual(len(f.data), 16)
        self.assertAlmostEqual(tensors.to_rows(f)[0][0], 0.1, places=6)
        i = tensors.int32_tensor([[3, -1]], 2)
        self.assertEqual(tensors.to_rows(i), [[3, -1]])
        self.assertEqual(list(tensors.bf16_tensor([], 7).shape), [0, 7])

    def test_bad_shapes_are_refused(self):
        with self.assertRaises(ValueError):
            tensors.fp32_tensor([[1.0], [1.0, 2.0]], 1)
        bad = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FP32, shape=[2, 2], data=b"\0" * 12)
        with self.assertRaises(ValueError):
            tensors.to_rows(bad)


@unittest.skipUnless(WORKER and os.path.exists(WORKER), "MOE_EP_WORKER not set")
class DataPlaneTest(unittest.TestCase):
    H, K, E = 8, 2, 4

    def setUp(self):
        self.procs, self.targets = start_workers(2)
        self.group = Group(self.targets)
        self.group.form()
        self.group.configure(hidden_size=self.H, num_layers=1, num_experts=self.E, top_k=self.K)
        self.group.allocate(
            hidden_size=self.H, top_k=self.K, num_experts=self.E, capacity_tokens=4
        )

    def tearDown(self):
        self.group.close()
        stop_workers(self.procs)

    def test_default_backend_is_auto(self):
        self.assertEqual(self.group.backend, "auto")
        # The workers resolved it (gloo without a GPU, nccl with one).
        self.assertIn(self.group.status()[0].backend, ("gloo", "nccl"))

    def test_identity_experts_forward(self):
        loaded = self.group.load_experts(layer=0, kind="identity")
        self.assertEqual([x.first_expert for x in loaded], [0, 2])  # 4 experts over 2 ranks
        self.assertEqual([x.num_local_experts for x in loaded], [2, 2])
        self.assertEqual([x.expert_bytes for x in loaded], [0, 0])

        agreed = self.group.agree_geometry(1, [3, 0])  # rank 1 has no tokens
        self.assertEqual(agreed.runtime_max_tokens_per_rank, 3)
        hidden = [[(t + 1) * (c - 3.5) for c in range(self.H)] for t in range(3)]
        ids = [[0, 3], [1, 2], [3, 0]]
        weights = [[0.5, 0.25], [1.0, 0.5], [0.125, 0.75]]
        results = self.group.forward(
            layer=0,
            epoch=1,
            hidden_size=self.H,
            top_k=self.K,
            inputs=[ForwardInput(hidden, ids, weights), ForwardInput([], [], [])],
        )
        # Identity experts: out[t] = sum_k w[t][k] * x[t], exact in bf16 here.
        expected = [[sum(w) * v for v in row] for row, w in zip(hidden, weights)]
        self.assertEqual(results[0].output, expected)
        self.assertEqual(results[1].output, [])
        self.assertEqual([r.runtime_max_tokens_per_rank for r in results], [3, 3])
        self.assertEqual([s.forwards for s in self.group.status()], [1, 1])
        for r in results:
            self.assertGreaterEqual(r.total_s, r.dispatch_s)
            self.assertLess(r.total_s, 10.0)  # seconds, not µs

    def test_identity_experts_forward_with_arrays(self):
        """Issue 31 item 4: NumPy in and out as raw bytes, the same values as
        the list path; bf16 bits stay bits, floats come back as float32."""
        self.group.load_experts(layer=0, kind="identity")
        self.group.agree_geometry(1, [3, 2])
        rng = np.random.default_rng(3)
        # Values with few mantissa bits and weights that are short binary
        # fractions: every w * x and each sum of them is exact in bf16, so
        # the expected output does not depend on where the worker rounds.
        hidden0 = (rng.integers(-16, 17, size=(3, self.H)) / 4).astype(np.float32)
        hidden1 = tensors.float32_to_bf16(rng.standard_normal((2, self.H)).astype(np.float32))
        ids0 = np.array([[0, 3], [1, 2], [3, 0]], np.int64)
        ids1 = np.array([[2, 1], [0, 0]], np.int32)
        w0 = np.array([[0.5, 0.25], [1.0, 0.5], [0.125, 0.75]], np.float32)
        w1 = np.array([[0.25, 0.25], [1.0, 1.0]], np.float64)
        results = self.group.forward(
            0, 1, self.H, self.K,
            [ForwardInput(hidden0, ids0, w0), ForwardInput(hidden1, ids1, w1)],
        )
        # Identity experts: out[t] = sum_k w[t][k] * x[t] of the bf16 input
        # (rank 1's weights sum to powers of two: exact too).
        x0 = tensors.bf16_to_float32(tensors.float32_to_bf16(hidden0))
        want0 = tensors.bf16_to_float32(tensors.float32_to_bf16(x0 * w0.sum(axis=1, keepdims=True)))
        self.assertEqual(results[0].output.dtype, np.float32)
        np.testing.assert_array_equal(results[0].output, want0)
        x1 = tensors.bf16_to_float32(hidden1)
        want1 = tensors.float32_to_bf16(x1 * w1.sum(axis=1, keepdims=True).astype(np.float32))
        self.assertEqual(results[1].output.dtype, np.uint16)
        np.testing.assert_array_equal(results[1].output, want1)
        # The list path answers the same numbers.
        self.group.agree_geometry(2, [3, 2])
        listed = self.group.forward(
            0, 2, self.H, self.K,
            [ForwardInput(hidden0.tolist(), ids0.tolist(), w0.tolist()),
             ForwardInput(x1.tolist(), ids1.tolist(), w1.tolist())],
        )
        np.testing.assert_array_equal(np.array(listed[0].output, np.float32), want0)
        np.testing.assert_array_equal(tensors.float32_to_bf16(np.array(listed[1].output, np.float32)),
                                      want1)
        # A wrong shape names the rank and the argument before any call.
        with self.assertRaises(ValueError) as caught:
            self.group.forward(0, 3, self.H, self.K,
                               [ForwardInput(hidden0[:, :4], ids0, w0), ForwardInput(hidden1, ids1, w1)])
        self.assertIn(f"inputs[0].hidden: expected shape [T, {self.H}], got [3, 4]", str(caught.exception))

    def test_forward_input_errors(self):
        with self.assertRaises(ValueError):
            self.group.forward(0, 1, self.H, self.K, [ForwardInput([], [], [])])
        with self.assertRaises(ValueError):  # a row of width H - 1
            self.group.forward(
                0, 1, self.H, self.K,
                [ForwardInput([[0.0] * (self.H - 1)], [[0, 1]], [[0.5, 0.5]]),
                 ForwardInput([], [], [])],
            )
        with self.assertRaises(ValueError):
            self.group.load_experts(layer=0, kind="linear")

    def test_benchmark(self):
        results = self.group.benchmark(
            tokens_per_rank=16, hidden_size=64, top_k=2, num_experts=4, iterations=3, warmup=1
        )
        self.assertEqual(len(results), 2)
        for r in results:
            # Seconds: a 16-token dispatch on loopback takes well under 1 s.
            self.assertGreater(r.dispatch_p50_s, 0)
            self.assertLess(r.dispatch_p99_s, 1.0)
            self.assertLessEqual(r.dispatch_p50_s, r.dispatch_p99_s)
            self.assertLessEqual(r.combine_p50_s, r.combine_p99_s)
            self.assertGreater(r.dispatch_bytes, 0)
        with self.assertRaises(GroupError) as caught:
            self.group.benchmark(16, 64, 2, 4, routing="zipf", iterations=1, warmup=0)
        self.assertEqual(caught.exception.codes, [grpc.StatusCode.INVALID_ARGUMENT] * 2)


if __name__ == "__main__":
    unittest.main()
