#!/usr/bin/env python3
"""The Python layer's per-call checks of an engine's CUDA tensors, piece by
piece (issue 30 item 3: Worker.dispatch's host time over the C call).

    PYTHONPATH=python python3 bench/python_checks_bench.py [--out FILE]

Times, on tensors of issue 30's shape (128 tokens, H 7168, top-8) on
cuda:0, each torch attribute read the fast path makes (type, dtype, shape,
get_device, is_contiguous, data_ptr, stride, dim, size) and whole
formulations of the three-tensor check: the module's _torch_inputs, the
same without get_device (the C library checks each pointer's device
itself: server/gpu_engine_args.h) and Worker._dispatch_fast's one pass.
p50 of 20,000 calls each, in us, printed as JSON. Needs torch and a CUDA device; no worker.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def p50(fn, n=20000):
    clock = time.perf_counter_ns
    s = []
    for _ in range(n):
        t0 = clock()
        fn()
        s.append(clock() - t0)
    s.sort()
    return round(s[len(s) // 2] / 1e3, 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from moe_ep_client import engine  # noqa: E402

    t, h, k = 128, 7168, 8
    x = torch.zeros(t, h, dtype=torch.bfloat16, device="cuda:0")
    ids = torch.zeros(t, k, dtype=torch.int32, device="cuda:0")
    w = torch.zeros(t, k, dtype=torch.float32, device="cuda:0")
    engine._TORCH_TYPES[:] = [torch.Tensor]
    engine._TORCH_DTYPE_OBJECTS.update(
        {"bf16": torch.bfloat16, "int32": torch.int32, "float32": torch.float32})

    class Info:
        device, hidden, top_k = 0, h, k

    info = Info()
    bf16 = torch.bfloat16
    shape = (t, h)
    tensor = torch.Tensor

    def no_device(x, ids, w):
        if type(x) is not tensor or x.dtype is not bf16 or x.shape != shape or \
                not x.is_contiguous():
            return None
        return x.data_ptr(), ids.data_ptr(), w.data_ptr()

    i32, f32 = torch.int32, torch.float32

    def one_pass(x, ids, w):
        # Worker._dispatch_fast's checks and addresses (no device read).
        if (type(x) is not tensor or type(ids) is not tensor or type(w) is not tensor
                or x.dtype is not bf16 or ids.dtype is not i32 or w.dtype is not f32):
            return None
        s = x.shape
        if len(s) != 2 or s[1] != h:
            return None
        choices = (s[0], k)
        if (ids.shape != choices or w.shape != choices or not x.is_contiguous()
                or not ids.is_contiguous() or not w.is_contiguous()):
            return None
        return x.data_ptr(), ids.data_ptr(), w.data_ptr()

    out = {
        "empty_lambda": p50(lambda: None),
        "type_is": p50(lambda: type(x) is tensor),
        "dtype_is": p50(lambda: x.dtype is bf16),
        "shape_eq_tuple": p50(lambda: x.shape == shape),
        "shape_read": p50(lambda: x.shape),
        "dim": p50(lambda: x.dim()),
        "size_1": p50(lambda: x.size(1)),
        "get_device": p50(lambda: x.get_device()),
        "is_contiguous": p50(lambda: x.is_contiguous()),
        "data_ptr": p50(lambda: x.data_ptr()),
        "torch_address_one": p50(lambda: engine._torch_address(x, "bf16", shape, 0)),
        "torch_inputs_three": p50(lambda: engine._torch_inputs(x, ids, w, info)),
        "one_tensor_no_device": p50(lambda: no_device(x, ids, w)),
        "dispatch_fast_checks_three": p50(lambda: one_pass(x, ids, w)),
        "buffer_init": p50(lambda: engine._Buffer(1, shape, True, True, 0)),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
