"""moe_ep_client.tensors: the array path of Forward (issue 31 item 4).

The packed ForwardRequest is parsed back with protobuf and compared byte by
byte with what NumPy says the tensors are; the float -> bf16 rounding is
checked on hand-worked values; the time of packing a DeepSeek-V3-sized rank
(4096 x 7168 bf16, 58.7 MB) is printed, not asserted (the figure goes into
the commit and the report: machines differ). Needs NumPy; torch cases run
when torch imports.
"""

import struct
import sys
import time
import unittest

import numpy as np

from moe_ep.v1 import tensor_pb2, worker_pb2
from moe_ep_client import tensors

try:
    import torch
except ImportError:  # the CI image has no torch
    torch = None


def parse(raw):
    return worker_pb2.ForwardRequest.FromString(raw)


class PackingTest(unittest.TestCase):
    def test_deepseek_rank_packs_to_the_same_bytes(self):
        T, H, K = 4096, 7168, 8
        rng = np.random.default_rng(7)
        hidden = rng.integers(0, 1 << 16, size=(T, H), dtype=np.uint16)
        ids = rng.integers(0, 256, size=(T, K)).astype(np.int64)  # any integer dtype
        weights = rng.random((T, K))  # float64: sent as float32
        times = []
        for _ in range(3):
            start = time.perf_counter()
            raw, kind = tensors.forward_request_bytes(5, 9, hidden, ids, weights, H, K)
            times.append(time.perf_counter() - start)
        print(
            f"\npack 4096x7168 bf16 rank: best {min(times) * 1e3:.1f} ms, "
            f"runs {', '.join(f'{t * 1e3:.1f}' for t in times)} ms ({len(raw)} bytes)",
            file=sys.stderr,
        )
        self.assertEqual(kind.name, "numpy-bf16")
        r = parse(raw)
        self.assertEqual((r.layer, r.epoch), (5, 9))
        self.assertEqual(r.hidden_states.dtype, tensor_pb2.DTYPE_BF16)
        self.assertEqual(list(r.hidden_states.shape), [T, H])
        self.assertEqual(len(r.hidden_states.data), T * H * 2)
        self.assertEqual(r.hidden_states.data, hidden.astype("<u2").tobytes())
        self.assertEqual(r.topk_ids.dtype, tensor_pb2.DTYPE_INT32)
        self.assertEqual(list(r.topk_ids.shape), [T, K])
        self.assertEqual(r.topk_ids.data, ids.astype("<i4").tobytes())
        self.assertEqual(r.topk_weights.dtype, tensor_pb2.DTYPE_FP32)
        self.assertEqual(r.topk_weights.data, weights.astype("<f4").tobytes())
        # The message protobuf itself would write parses to the same fields.
        reference = worker_pb2.ForwardRequest(layer=5, epoch=9)
        reference.hidden_states.CopyFrom(
            tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_BF16, shape=[T, H], data=hidden.tobytes())
        )
        reference.topk_ids.CopyFrom(r.topk_ids)
        reference.topk_weights.CopyFrom(r.topk_weights)
        self.assertEqual(r, reference)

    def test_small_case_by_hand(self):
        # Two tokens, H = 3: bf16 bits given; the wire bytes of the data are
        # the little-endian bits in row-major order.
        hidden = np.array([[0x3F80, 0xC000, 0x0001], [0x7FC0, 0x0000, 0x8000]], np.uint16)
        raw, _ = tensors.forward_request_bytes(0, 1, hidden, [[1], [0]], [[0.5], [2.0]], 3, 1)
        r = parse(raw)
        self.assertEqual(r.hidden_states.data, bytes.fromhex("803f00c00100c07f00000080"))
        self.assertEqual(r.topk_ids.data, struct.pack("<2i", 1, 0))
        self.assertEqual(r.topk_weights.data, struct.pack("<2f", 0.5, 2.0))

    def test_empty_rank(self):
        raw, _ = tensors.forward_request_bytes(
            0, 1, np.zeros((0, 8), np.uint16), np.zeros((0, 2), np.int32), [], 8, 2
        )
        r = parse(raw)
        self.assertEqual(list(r.hidden_states.shape), [0, 8])
        self.assertEqual(list(r.topk_ids.shape), [0, 2])
        self.assertEqual(r.hidden_states.data, b"")

    def test_float_input_rounds_to_nearest_even(self):
        # As test_data_plane's list case: 1 + 2^-8 ties to 1.0, 1 + 3 * 2^-8 to
        # 1 + 2^-6; NaN is the quiet NaN 0x7FC0, also for payloads whose bits
        # + 0x7FFF would wrap around 32 bits.
        values = np.array(
            [[1.0, -2.0, 1.00390625, 1.01171875, 3.140625, np.nan]], np.float32
        )
        values.view(np.uint32)[0, 5] = 0xFFFFFFFF
        raw, kind = tensors.forward_request_bytes(0, 1, values, [[0]], [[1.0]], 6, 1)
        self.assertEqual(kind.name, "numpy-float")
        bits = struct.unpack("<6H", parse(raw).hidden_states.data)
        self.assertEqual(bits, (0x3F80, 0xC000, 0x3F80, 0x3F82, 0x4049, 0x7FC0))
        self.assertEqual(
            tensors.bf16_to_float32(np.array(bits[:5], np.uint16)).tolist(),
            [1.0, -2.0, 1.0, 1.015625, 3.140625],
        )

    def test_non_contiguous_input_is_packed_in_order(self):
        base = np.arange(24, dtype=np.uint16).reshape(4, 6)
        view = base[:, ::2]  # [4, 3], strided
        raw, _ = tensors.forward_request_bytes(0, 1, view, np.zeros((4, 1), np.int32),
                                               np.ones((4, 1), np.float32), 3, 1)
        self.assertEqual(parse(raw).hidden_states.data, np.ascontiguousarray(view).tobytes())

    def test_errors_name_the_argument(self):
        ok_ids, ok_w = np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32)
        cases = [
            ((np.zeros((2, 4), np.int32), ok_ids, ok_w), TypeError, "hidden: expected uint16"),
            ((np.zeros((2, 5), np.uint16), ok_ids, ok_w), ValueError, "hidden: expected shape [T, 4], got [2, 5]"),
            ((np.zeros((2, 4), np.uint16), np.zeros((3, 1), np.int32), ok_w), ValueError,
             "topk_ids: expected shape [2, 1], got [3, 1]"),
            ((np.zeros((2, 4), np.uint16), ok_w, ok_w), TypeError, "topk_ids: expected an integer dtype"),
            ((np.zeros((2, 4), np.uint16), np.full((2, 1), 2**40), ok_w), ValueError,
             "topk_ids: values outside int32"),
        ]
        for args, error, text in cases:
            with self.assertRaises(error) as caught:
                tensors.forward_request_bytes(0, 1, *args, 4, 1)
            self.assertIn(text, str(caught.exception))

    def test_output_kinds(self):
        bits = np.array([[0x3F80, 0x4049], [0xC000, 0x0000]], np.uint16)
        t = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_BF16, shape=[2, 2], data=bits.tobytes())
        out = tensors.output_from_tensor(t, tensors.ForwardOutputKind("numpy-bf16"))
        self.assertEqual(out.dtype, np.uint16)
        self.assertEqual(out.tolist(), bits.tolist())
        out[0, 0] = 1  # writable, not a view of the reply
        f = tensors.output_from_tensor(t, tensors.ForwardOutputKind("numpy-float"))
        self.assertEqual(f.dtype, np.float32)
        self.assertEqual(f.tolist(), [[1.0, 3.140625], [-2.0, 0.0]])
        self.assertEqual(tensors.output_from_tensor(t, tensors.ForwardOutputKind("list")),
                         [[1.0, 3.140625], [-2.0, 0.0]])


@unittest.skipIf(torch is None, "torch is not installed")
class TorchPackingTest(unittest.TestCase):
    def test_bf16_tensor_goes_as_its_bits(self):
        x = torch.tensor([[1.0, -2.0, 3.140625]], dtype=torch.bfloat16)
        raw, kind = tensors.forward_request_bytes(0, 1, x, torch.zeros((1, 1), dtype=torch.int32),
                                                  torch.ones((1, 1)), 3, 1)
        self.assertEqual(kind.name, "torch-bf16")
        self.assertEqual(parse(raw).hidden_states.data, struct.pack("<3H", 0x3F80, 0xC000, 0x4049))
        t = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_BF16, shape=[1, 3], data=parse(raw).hidden_states.data)
        out = tensors.output_from_tensor(t, kind)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(out, x))


if __name__ == "__main__":
    unittest.main()
