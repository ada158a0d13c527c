"""moe_ep.v1.Tensor <-> Python lists (proto/moe_ep/v1/tensor.proto).

A Tensor is dense, row-major, little-endian: `data` holds exactly
product(shape) * sizeof(dtype) bytes. bf16 is the upper half of an IEEE-754
float32, rounded to nearest even (as the worker's core/bf16.h does). Only the
standard library (struct); pure functions, thread-safe.
"""

from __future__ import annotations

import math
import struct
from typing import List, Sequence

from moe_ep.v1 import tensor_pb2

Matrix = List[List[float]]


def _flatten(rows: Sequence[Sequence[float]], width: int, what: str) -> List[float]:
    flat: List[float] = []
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"{what}: row {i} has {len(row)} entries, expected {width}")
        flat.extend(row)
    return flat


def _float_to_bf16_bits(value: float) -> int:
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    if math.isnan(value):
        return 0x7FC0
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def bf16_tensor(rows: Sequence[Sequence[float]], width: int) -> tensor_pb2.Tensor:
    """[len(rows), width] bf16; ValueError for a row of another width."""
    flat = _flatten(rows, width, "bf16 tensor")
    data = struct.pack(f"<{len(flat)}H", *(_float_to_bf16_bits(v) for v in flat))
    return tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_BF16, shape=[len(rows), width], data=data)


def fp32_tensor(rows: Sequence[Sequence[float]], width: int) -> tensor_pb2.Tensor:
    """[len(rows), width] fp32; ValueError for a row of another width."""
    flat = _flatten(rows, width, "fp32 tensor")
    data = struct.pack(f"<{len(flat)}f", *flat)
    return tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FP32, shape=[len(rows), width], data=data)


def int32_tensor(rows: Sequence[Sequence[int]], width: int) -> tensor_pb2.Tensor:
    """[len(rows), width] int32; ValueError for a row of another width."""
    flat = _flatten(rows, width, "int32 tensor")
    data = struct.pack(f"<{len(flat)}i", *flat)
    return tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT32, shape=[len(rows), width], data=data)


def to_rows(tensor: tensor_pb2.Tensor) -> Matrix:
    """A 2-D bf16 / fp32 / int32 Tensor as a list of rows (floats; ints for int32).

    ValueError for another rank or dtype, or a data length that does not match.
    """
    if len(tensor.shape) != 2:
        raise ValueError(f"tensor: expected 2 dimensions, got shape {list(tensor.shape)}")
    rows, cols = tensor.shape
    formats = {
        tensor_pb2.DTYPE_BF16: ("H", 2),
        tensor_pb2.DTYPE_FP32: ("f", 4),
        tensor_pb2.DTYPE_INT32: ("i", 4),
    }
    if tensor.dtype not in formats:
        raise ValueError(f"tensor: unsupported dtype {tensor_pb2.DType.Name(tensor.dtype)}")
    code, size = formats[tensor.dtype]
    if len(tensor.data) != rows * cols * size:
        raise ValueError(
            f"tensor: {len(tensor.data)} data bytes, expected {rows} * {cols} * {size}"
        )
    values = struct.unpack(f"<{rows * cols}{code}", tensor.data)
    if tensor.dtype == tensor_pb2.DTYPE_BF16:
        values = struct.unpack(f"<{rows * cols}f", b"".join(struct.pack("<I", v << 16) for v in values))
    return [list(values[r * cols : (r + 1) * cols]) for r in range(rows)]
