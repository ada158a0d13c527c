"""moe_ep.v1.Tensor <-> Python values (proto/moe_ep/v1/tensor.proto).

A Tensor is dense, row-major, little-endian: `data` holds exactly
product(shape) * sizeof(dtype) bytes. bf16 is the upper half of an IEEE-754
float32, rounded to nearest even (as the worker's core/bf16.h does; NaN ->
0x7FC0).

Two paths (issue 31 item 4):
  - arrays, the fast one: NumPy arrays and torch tensors go in and out as
    raw bytes. Hidden states are bf16 on the wire; a bf16 input (a torch
    bfloat16 tensor, or a NumPy uint16 array of bf16 bit patterns, as
    moe_ep_client.engine takes them) is sent without conversion, and
    forward_request_bytes() copies its bytes once, into the serialized
    request (a 4096 x 7168 rank: one 58.7 MB copy). Float inputs (float32,
    float64) are rounded to bf16 first. Outputs come back as the same kind
    (ForwardOutputKind): bf16 stays bf16, float comes back as float32.
  - nested lists (bf16_tensor, fp32_tensor, int32_tensor, to_rows): the
    standard library only (struct), for small inputs and for Python without
    NumPy.
NumPy is imported only when an array is given; torch only when a torch tensor
is. Pure functions, thread-safe.
"""

from __future__ import annotations

import math
import struct
from typing import Any, List, Sequence, Tuple

from moe_ep.v1 import tensor_pb2, worker_pb2

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
    rows, cols, code, _ = _checked_2d(tensor)
    values = struct.unpack(f"<{rows * cols}{code}", tensor.data)
    if tensor.dtype == tensor_pb2.DTYPE_BF16:
        values = struct.unpack(f"<{rows * cols}f", b"".join(struct.pack("<I", v << 16) for v in values))
    return [list(values[r * cols : (r + 1) * cols]) for r in range(rows)]


_FORMATS = {
    tensor_pb2.DTYPE_BF16: ("H", 2),
    tensor_pb2.DTYPE_FP32: ("f", 4),
    tensor_pb2.DTYPE_INT32: ("i", 4),
}


def _checked_2d(tensor: tensor_pb2.Tensor) -> Tuple[int, int, str, int]:
    if len(tensor.shape) != 2:
        raise ValueError(f"tensor: expected 2 dimensions, got shape {list(tensor.shape)}")
    rows, cols = tensor.shape
    if tensor.dtype not in _FORMATS:
        raise ValueError(f"tensor: unsupported dtype {tensor_pb2.DType.Name(tensor.dtype)}")
    code, size = _FORMATS[tensor.dtype]
    if len(tensor.data) != rows * cols * size:
        raise ValueError(
            f"tensor: {len(tensor.data)} data bytes, expected {rows} * {cols} * {size}"
        )
    return rows, cols, code, size


# ----------------------------------------------------------------- arrays


def _numpy() -> Any:
    import numpy

    return numpy


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _is_numpy(x: Any) -> bool:
    return type(x).__module__ == "numpy"


def is_array(x: Any) -> bool:
    """A NumPy array or a torch tensor (the fast path), not a nested list."""
    return _is_numpy(x) or _is_torch(x)


def float32_to_bf16(values: Any) -> Any:
    """NumPy float array -> uint16 bf16 bit patterns, nearest even (NaN -> 0x7FC0).

    Works in place on one temporary; a 4096 x 7168 float32 array takes about
    0.5 s on a 2-core machine, so pass bf16 when you have it.
    """
    np = _numpy()
    f = np.ascontiguousarray(values, dtype=np.float32)
    bits = f.view(np.uint32)
    t = bits >> np.uint32(16)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += bits  # wraps only for NaN payloads near 0xFFFFFFFF, fixed below
    t >>= np.uint32(16)
    out = t.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_to_float32(bits: Any) -> Any:
    """NumPy uint16 bf16 bit patterns -> float32 (exact)."""
    np = _numpy()
    u = np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32)
    u <<= np.uint32(16)
    return u.view(np.float32)


class ForwardOutputKind:
    """What Forward's output is turned into, following the hidden input.

    "list" (nested lists of floats), "numpy-bf16" (uint16 bit patterns),
    "numpy-float" (float32), "torch-bf16" (torch.bfloat16), "torch-float"
    (torch.float32); for torch, `device` is the input's.
    """

    __slots__ = ("name", "device")

    def __init__(self, name: str, device: Any = None):
        self.name = name
        self.device = device

    def __repr__(self) -> str:
        return f"ForwardOutputKind({self.name!r})"


def hidden_bf16(hidden: Any, width: int, what: str = "hidden") -> Tuple[Any, int, ForwardOutputKind]:
    """An array [T, width] as a C-contiguous NumPy uint16 array of bf16 bits.

    Returns (bits, T, kind). bf16 inputs are not copied (a non-contiguous one
    is, once); float inputs are rounded. TypeError for another dtype or
    kind, ValueError for another shape (both naming `what`).
    """
    np = _numpy()
    if _is_torch(hidden):
        import torch

        device = hidden.device
        t = hidden.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
            kind = ForwardOutputKind("torch-bf16", device)
        elif t.dtype in (torch.float32, torch.float64, torch.float16):
            bits = float32_to_bf16(t.float().numpy())
            kind = ForwardOutputKind("torch-float", device)
        else:
            raise TypeError(f"{what}: expected torch.bfloat16 or a float dtype, got {t.dtype}")
    elif _is_numpy(hidden):
        if hidden.dtype == np.uint16:
            bits = np.ascontiguousarray(hidden)
            kind = ForwardOutputKind("numpy-bf16")
        elif hidden.dtype.kind == "f":
            bits = float32_to_bf16(hidden)
            kind = ForwardOutputKind("numpy-float")
        else:
            raise TypeError(
                f"{what}: expected uint16 (bf16 bit patterns) or a float dtype, got {hidden.dtype}"
            )
    else:
        raise TypeError(f"{what}: expected a NumPy array or a torch tensor, got {type(hidden).__name__}")
    if bits.ndim != 2 or bits.shape[1] != width:
        raise ValueError(f"{what}: expected shape [T, {width}], got {list(bits.shape)}")
    return bits, int(bits.shape[0]), kind


def _small_array(x: Any, rows: int, width: int, dtype: str, what: str) -> bytes:
    """topk ids / weights [rows, width] as little-endian int32 / float32 bytes."""
    np = _numpy()
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if dtype == "int32":
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"{what}: expected an integer dtype, got {a.dtype}")
        if a.size and a.dtype != np.int32 and (a.min() < -(2**31) or a.max() >= 2**31):
            raise ValueError(f"{what}: values outside int32")
        a = np.ascontiguousarray(a, dtype="<i4")
    else:
        if a.size and a.dtype.kind not in "fiu":
            raise TypeError(f"{what}: expected a float dtype, got {a.dtype}")
        a = np.ascontiguousarray(a, dtype="<f4")
    if a.size == 0 and rows == 0:
        a = a.reshape(0, width)
    if a.shape != (rows, width):
        raise ValueError(f"{what}: expected shape [{rows}, {width}], got {list(a.shape)}")
    return a.tobytes()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _length_delimited(field: Any, length: int) -> bytes:
    """The tag and length of a length-delimited field (wire type 2)."""
    return _varint(field.number << 3 | 2) + _varint(length)


_HIDDEN_FIELD = worker_pb2.ForwardRequest.DESCRIPTOR.fields_by_name["hidden_states"]
_DATA_FIELD = tensor_pb2.Tensor.DESCRIPTOR.fields_by_name["data"]


def forward_request_bytes(
    layer: int,
    epoch: int,
    hidden: Any,
    topk_ids: Any,
    topk_weights: Any,
    hidden_size: int,
    top_k: int,
) -> Tuple[bytes, ForwardOutputKind]:
    """The serialized moe_ep.v1.ForwardRequest of one rank, from arrays.

    hidden [T, hidden_size] (see hidden_bf16), topk_ids [T, top_k] (integer),
    topk_weights [T, top_k] (float). The hidden bytes are copied once, into
    the returned bytes: the message is protobuf's serialization of the request
    without hidden_states.data, followed by a second hidden_states field that
    holds only `data`, which every parser merges into the first (protobuf
    encoding: "the parser merges multiple instances of the same [embedded
    message] field"). Returns (bytes, the kind Forward's output takes).
    """
    bits, rows, kind = hidden_bf16(hidden, hidden_size, "hidden")
    request = worker_pb2.ForwardRequest(layer=layer, epoch=epoch)
    request.hidden_states.dtype = tensor_pb2.DTYPE_BF16
    request.hidden_states.shape.extend([rows, hidden_size])
    request.topk_ids.dtype = tensor_pb2.DTYPE_INT32
    request.topk_ids.shape.extend([rows, top_k])
    request.topk_ids.data = _small_array(topk_ids, rows, top_k, "int32", "topk_ids")
    request.topk_weights.dtype = tensor_pb2.DTYPE_FP32
    request.topk_weights.shape.extend([rows, top_k])
    request.topk_weights.data = _small_array(topk_weights, rows, top_k, "float32", "topk_weights")
    n = bits.nbytes
    inner = _length_delimited(_DATA_FIELD, n)
    outer = _length_delimited(_HIDDEN_FIELD, len(inner) + n)
    payload = memoryview(bits.reshape(-1)).cast("B") if n else b""
    return b"".join([request.SerializeToString(), outer, inner, payload]), kind


def output_from_tensor(tensor: tensor_pb2.Tensor, kind: ForwardOutputKind) -> Any:
    """Forward's bf16 output [T, H] as `kind` says (a writable array)."""
    if kind.name == "list":
        return to_rows(tensor)
    rows, cols, _, _ = _checked_2d(tensor)
    if tensor.dtype != tensor_pb2.DTYPE_BF16:
        raise ValueError(f"output: expected DTYPE_BF16, got {tensor_pb2.DType.Name(tensor.dtype)}")
    np = _numpy()
    bits = np.frombuffer(bytearray(tensor.data), dtype="<u2").reshape(rows, cols)
    if kind.name == "numpy-bf16":
        return bits
    if kind.name == "numpy-float":
        return bf16_to_float32(bits)
    import torch

    t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    if kind.name == "torch-float":
        t = t.float()
    return t if kind.device is None or kind.device.type == "cpu" else t.to(kind.device)
