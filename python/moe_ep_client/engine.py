"""The moe-ep worker embedded in an engine's process, over libmoe_ep.so's C API.

Loaded with ctypes (no compiler, no Python headers; Python >= 3.9). The C API
is server/moe_ep.h (DESIGN §14, issue 16); this module adds argument checks
that name the argument before any call, and NumPy / torch buffers:

    from moe_ep_client.engine import Worker, Dispatcher
    worker = Worker(["--listen=127.0.0.1:0", "--backend=gloo"])  # serves gRPC
    print(worker.address)                 # give this to the orchestrator
    # `moe-ep up --targets ...` configures it; the wait returns once every
    # rank is set up (experts="own": the engine runs its own experts;
    # "worker": every sparse layer's experts are loaded on every rank).
    worker.wait_ready(timeout_s=60, experts="own")
    dispatcher = Dispatcher(worker)
    out = dispatcher.dispatch(hidden_states, topk_ids, topk_weights)
    # out.hidden_states [E, R, H], out.topk_ids / out.topk_weights [E, R, K],
    # out.num_recv_tokens_per_expert [L], out.num_recv_tokens_per_source [E]
    y = dispatcher.combine(expert_outputs)  # [E, R, H] -> [T, H]

Tensors: hidden states are bf16 ([T, H]): torch.bfloat16 tensors, or NumPy
uint16 arrays holding bf16 bit patterns (float32_to_bf16 / bf16_to_float32
convert); topk_ids int32 [T, K]; topk_weights float32 [T, K]. All must be
C-contiguous. On the CPU backend ("gloo") they live in host memory; on the
GPU backend ("nccl") they are CUDA torch tensors on the worker's device
(WorkerInfo.device), passed by data_ptr() with
torch.cuda.current_stream().cuda_stream: every call only enqueues on that
stream and can be captured in a torch CUDA graph (see Dispatcher's
graph_bucket, Worker.graph_token / check_graph, and server/moe_ep.h).

The library: MOE_EP_LIBRARY (a path), else libmoe_ep.so.0 on the loader's
path. Errors: EngineError (the C status code and message) from the library,
TypeError / ValueError naming the argument from the checks here. A data
call whose checks here fail still enters the call's opening round on the
CPU plane, refusing it (Worker.refuse), so its peers return at once with
EngineError ABORTED naming this rank instead of waiting out the group's
timeout (issue 30 item 1).
Thread safety: as the C API (every call is thread-safe; the data calls are
serialized by the worker), and Worker.stop() may run beside other calls: it
waits for the calls in flight on other threads, and later calls raise
ValueError "worker: stopped".
"""

import ctypes
import functools
import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

__all__ = [
    "Dispatcher",
    "DispatchOutput",
    "EngineError",
    "Worker",
    "WorkerInfo",
    "bf16_to_float32",
    "float32_to_bf16",
    "load_library",
    "version",
]

# moe_ep_status values (absl / gRPC status codes).
_CODE_NAMES = {
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
    100: "RECAPTURE",
}
_RECAPTURE = 100
_ABI_VERSION = 2
_STEP_EXPERTS = {"own": 0, "worker": 1}  # MOE_EP_STEPS_OWN_EXPERTS, MOE_EP_STEPS_WORKER_EXPERTS
_BACKENDS = {1: "gloo", 2: "nccl"}


class EngineError(RuntimeError):
    """A failed C call: `code` (e.g. "ABORTED"), `status` (its number), `message`."""

    def __init__(self, call: str, status: int, message: str):
        self.call = call
        self.status = status
        self.code = _CODE_NAMES.get(status, str(status))
        self.message = message
        super().__init__(f"{call}: {self.code}: {message}")


class _WorkerInfoStruct(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("generation", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("top_k", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("first_expert", ctypes.c_int32),
        ("num_local_experts", ctypes.c_int32),
        ("capacity_tokens", ctypes.c_int64),
        ("invalid_expert_id", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("epoch", ctypes.c_int64),
        ("runtime_max_tokens_per_rank", ctypes.c_int64),
        ("device", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class WorkerInfo:
    """The allocated group as this rank sees it (moe_ep_worker_info)."""

    rank: int
    world_size: int  # E
    generation: int
    hidden: int  # H
    top_k: int  # K
    num_experts: int
    first_expert: int
    num_local_experts: int  # L
    capacity_tokens: int  # N
    invalid_expert_id: int
    backend: str  # "gloo" or "nccl"
    epoch: int
    runtime_max_tokens_per_rank: int  # R
    device: int = -1  # CUDA device ordinal (nccl), -1 (gloo)


_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_I64 = ctypes.c_int64
_SIGNATURES = {
    "moe_ep_version": (ctypes.c_char_p, []),
    "moe_ep_abi_version": (_I32, []),
    "moe_ep_last_error": (ctypes.c_char_p, []),
    "moe_ep_noop": (_I32, []),
    "moe_ep_worker_start": (_I32, [_I32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_P)]),
    "moe_ep_worker_stop": (_I32, [_P, _I64]),
    "moe_ep_worker_address": (_I32, [_P, ctypes.POINTER(ctypes.c_char_p)]),
    "moe_ep_worker_wait_ready": (_I32, [_P, _I64]),
    "moe_ep_worker_wait_ready_for_steps": (_I32, [_P, _I32, _I64]),
    "moe_ep_worker_info_get": (_I32, [_P, ctypes.POINTER(_WorkerInfoStruct)]),
    "moe_ep_sync_token_counts": (_I32, [_P, _I64, _P, _P]),
    "moe_ep_commit_geometry": (_I32, [_P, _I64, _I64, _I64]),
    "moe_ep_dispatch": (_I32, [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64]),
    "moe_ep_dispatch_only": (_I32, [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64]),
    "moe_ep_combine": (_I32, [_P, _P, _I64, _P, _P, _I64]),
    "moe_ep_forward": (_I32, [_P, _I32, _P, _P, _P, _I64, _P, _P, _I64]),
    "moe_ep_sync_token_counts_async": (_I32, [_P, _P, _P, _P, _I64]),
    "moe_ep_check_step": (_I32, [_P, _I64]),
    "moe_ep_graph_token": (_I32, [_P, ctypes.POINTER(ctypes.c_uint64)]),
    "moe_ep_check_graph": (_I32, [_P, ctypes.c_uint64]),
    "moe_ep_receive_buffers": (_I32, [_P, ctypes.POINTER(_P), ctypes.POINTER(_P),
                                      ctypes.POINTER(_P), ctypes.POINTER(_I64)]),
}

_library: Optional[ctypes.CDLL] = None


def load_library(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads libmoe_ep.so once: `path`, else $MOE_EP_LIBRARY, else libmoe_ep.so.0.

    Raises OSError naming what was tried, or RuntimeError when the library's
    ABI version differs from this module's.
    """
    global _library
    if _library is not None and path is None:
        return _library
    name = path or os.environ.get("MOE_EP_LIBRARY") or "libmoe_ep.so.0"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise OSError(
            f"cannot load {name} ({e}); set MOE_EP_LIBRARY to the path of libmoe_ep.so"
        ) from e
    for fn, (restype, argtypes) in _SIGNATURES.items():
        f = getattr(lib, fn)
        f.restype = restype
        f.argtypes = argtypes
    abi = lib.moe_ep_abi_version()
    if abi != _ABI_VERSION:
        raise RuntimeError(f"{name}: C ABI version {abi}, this module expects {_ABI_VERSION}")
    _library = lib
    return lib


def version() -> str:
    """The library's version, e.g. "0.1.0"."""
    return load_library().moe_ep_version().decode()


def _check(lib: ctypes.CDLL, call: str, status: int) -> None:
    if status != 0:
        raise EngineError(call, status, lib.moe_ep_last_error().decode(errors="replace"))


# ------------------------------------------------------------------ tensors


_np: Any = None


def _numpy() -> Any:
    global _np
    if _np is None:
        import numpy

        _np = numpy
    return _np


def float32_to_bf16(values: Any) -> Any:
    """NumPy float32 -> uint16 bf16 bit patterns (round to nearest even)."""
    np = _numpy()
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def bf16_to_float32(bits: Any) -> Any:
    """NumPy uint16 bf16 bit patterns -> float32 (exact)."""
    np = _numpy()
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(
        np.float32
    )


_TORCH_DTYPES = {"bf16": "bfloat16", "int32": "int32", "float32": "float32", "int64": "int64"}
_NUMPY_DTYPES = {"bf16": "uint16", "int32": "int32", "float32": "float32", "int64": "int64"}
_NUMPY_DTYPE_OBJECTS: dict = {}  # "bf16" -> numpy.dtype("uint16"), filled on first use
_TORCH_DTYPE_OBJECTS: dict = {}  # "bf16" -> torch.bfloat16, filled on first use


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _address(x: Any) -> Optional[int]:
    """The first byte of C-contiguous NumPy array `x` (None when empty): the
    buffer protocol for writeable arrays (4x faster than x.ctypes.data),
    x.ctypes.data otherwise."""
    if x.size == 0:
        return None
    try:
        return ctypes.addressof(ctypes.c_byte.from_buffer(x))
    except (TypeError, ValueError, BufferError):
        return int(x.ctypes.data)


class _Buffer:
    """A checked argument: its address, shape and kind."""

    __slots__ = ("ptr", "shape", "torch", "cuda", "device")  # device: CUDA ordinal or None

    def __init__(self, ptr: Optional[int], shape: Tuple[int, ...], torch: bool, cuda: bool,
                 device: Any):
        self.ptr = ptr
        self.shape = shape
        self.torch = torch
        self.cuda = cuda
        self.device = device


# [torch.Tensor] once a torch tensor was checked (an exact type test is the
# fast path of _buffer; subclasses go through _is_torch).
_TORCH_TYPES: List[Any] = []

# (torch.Tensor, torch.bfloat16, torch.int32, torch.float32, the current raw
# stream of a device ordinal) once a torch tensor was checked: what the data
# calls' steady-state paths (Worker._dispatch_fast, _combine_fast) compare
# against, as locals.
_TORCH_FAST: Optional[Tuple[Any, Any, Any, Any, Callable[[int], int]]] = None


def _init_torch_fast(torch: Any) -> None:
    global _TORCH_FAST, _current_raw_stream
    if not _TORCH_TYPES:
        _TORCH_TYPES.append(torch.Tensor)
    if _current_raw_stream is None:
        # torch's own fast path (what its compiled code calls), else the
        # public API: the same value.
        _current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    for name in ("bf16", "int32", "float32"):
        _TORCH_DTYPE_OBJECTS.setdefault(name, getattr(torch, _TORCH_DTYPES[name]))
    _TORCH_FAST = (torch.Tensor, torch.bfloat16, torch.int32, torch.float32, _current_raw_stream)


def _shape_error(name: str, shape: Tuple[Optional[int], ...], got: Tuple[int, ...]) -> ValueError:
    want_text = ", ".join("*" if d is None else str(d) for d in shape)
    return ValueError(f"{name}: expected shape [{want_text}], got {list(got)}")


def _shape_ok(shape: Tuple[Optional[int], ...], got: Tuple[int, ...]) -> bool:
    """`got` matches `shape`, whose first size may be None (any)."""
    if len(got) != len(shape):
        return False
    if shape[0] is None:
        return got[1:] == shape[1:]
    return got == shape


def _buffer(name: str, x: Any, dtype: str, shape: Tuple[Optional[int], ...],
            cuda: bool, cuda_device: int = -1, written: bool = False) -> _Buffer:
    """Checks `x` (NumPy array or torch tensor): dtype, rank, sizes (the first may be None = any),
    C-contiguity and device (CUDA device `cuda_device` when `cuda` and
    cuda_device >= 0, any CUDA device when cuda_device < 0, else host);
    `written`: the library writes into it, so a read-only NumPy array is refused.
    Raises TypeError or ValueError naming `name`."""
    is_torch = type(x) in _TORCH_TYPES or _is_torch(x)
    np = None if is_torch else _numpy()
    if np is not None and type(x) is np.ndarray:
        want = _NUMPY_DTYPE_OBJECTS.get(dtype)
        if want is None:
            want = _NUMPY_DTYPE_OBJECTS.setdefault(dtype, np.dtype(_NUMPY_DTYPES[dtype]))
        if cuda:
            raise ValueError(
                f"{name}: expected a CUDA torch tensor for the nccl backend, got a NumPy array")
        if x.dtype != want:
            what = "uint16 (bf16 bit patterns)" if dtype == "bf16" else _NUMPY_DTYPES[dtype]
            raise TypeError(f"{name}: expected dtype {what}, got {x.dtype}")
        got_shape = x.shape
        if not _shape_ok(shape, got_shape):
            raise _shape_error(name, shape, got_shape)
        if not x.flags.c_contiguous:
            raise ValueError(
                f"{name}: must be C-contiguous (call .contiguous() / np.ascontiguousarray)")
        if written and not x.flags.writeable:
            raise ValueError(f"{name}: must be writeable (the result is written into it)")
        return _Buffer(_address(x), got_shape, False, False, None)
    if is_torch:
        want_t = _TORCH_DTYPE_OBJECTS.get(dtype)
        if want_t is None:
            import torch

            _init_torch_fast(torch)
            want_t = _TORCH_DTYPE_OBJECTS.setdefault(dtype, getattr(torch, _TORCH_DTYPES[dtype]))
        if x.dtype != want_t:
            raise TypeError(f"{name}: expected dtype torch.{_TORCH_DTYPES[dtype]}, got {x.dtype}")
        got_shape = tuple(x.shape)  # torch.Size: a tuple of ints
        index = x.get_device()  # -1 on the CPU
        on_cuda = index >= 0
        if on_cuda != cuda:
            raise ValueError(
                f"{name}: expected a {'CUDA' if cuda else 'CPU'} tensor for this backend, "
                f"got one on {x.device}"
            )
        if on_cuda and cuda_device >= 0 and index != cuda_device:
            raise ValueError(
                f"{name}: expected a tensor on cuda:{cuda_device} (the worker's device), "
                f"got one on {x.device}")
        if not _shape_ok(shape, got_shape):
            raise _shape_error(name, shape, got_shape)
        if not x.is_contiguous():
            raise ValueError(
                f"{name}: must be C-contiguous (call .contiguous() / np.ascontiguousarray)")
        return _Buffer(x.data_ptr() or None, got_shape, True, on_cuda, index if on_cuda else None)
    raise TypeError(f"{name}: expected a NumPy array or a torch tensor, got {type(x).__name__}")


def _torch_address(x: Any, dtype: str, shape: Tuple[int, ...], device: int) -> Any:
    """x's address (None when empty) when x is an exact torch.Tensor of
    `dtype` and `shape`, C-contiguous, on CUDA `device`; False otherwise or
    before torch's types are known (then _buffer checks it and names it)."""
    if (not _TORCH_TYPES or device < 0 or type(x) is not _TORCH_TYPES[0]
            or x.dtype is not _TORCH_DTYPE_OBJECTS.get(dtype) or x.shape != shape
            or x.get_device() != device or not x.is_contiguous()):
        return False
    return x.data_ptr() or None


def _torch_inputs(hidden: Any, topk_ids: Any, topk_weights: Any,
                  info: Any) -> Optional[Tuple[_Buffer, Optional[int], Optional[int]]]:
    """A CUDA engine's usual dispatch arguments, checked in one pass (issue
    30 item 3: the host time of a call): exact torch.Tensors of bf16 /
    int32 / float32, shapes [T, H] / [T, K] / [T, K], C-contiguous, on the
    worker's device. -> (hidden's _Buffer, the ids' and weights' addresses),
    or None when anything differs or torch's types are not known yet: then
    _buffer's checks run and name the argument."""
    if not _TORCH_TYPES or type(hidden) is not _TORCH_TYPES[0] or len(hidden.shape) != 2:
        return None
    d = info.device
    shape = (hidden.shape[0], info.hidden)
    choices = (shape[0], info.top_k)
    h = _torch_address(hidden, "bf16", shape, d)
    ids = _torch_address(topk_ids, "int32", choices, d)
    w = _torch_address(topk_weights, "float32", choices, d)
    if h is False or ids is False or w is False:
        return None
    return _Buffer(h, shape, True, True, d), ids, w


def _empty(like: _Buffer, shape: Sequence[int], dtype: str) -> Any:
    if like.torch:
        import torch

        return torch.empty(tuple(shape), dtype=getattr(torch, _TORCH_DTYPES[dtype]),
                           device=like.device)
    np = _numpy()
    return np.empty(tuple(shape), dtype=_NUMPY_DTYPES[dtype])


def _ptr(x: Any) -> Optional[int]:
    return (int(x.data_ptr()) or None) if _is_torch(x) else _address(x)


_current_raw_stream: Any = None  # device ordinal -> the current cudaStream_t as an int


def _stream(buf: _Buffer) -> Optional[int]:
    """The current torch stream of `buf`'s device (None on the host, and for
    the legacy default stream)."""
    if not buf.cuda:
        return None
    if _current_raw_stream is None:
        import torch

        _init_torch_fast(torch)
    return _current_raw_stream(buf.device) or None


def _counts(like: _Buffer, size: int) -> Any:
    """int64 [size] zeros: on `like`'s CUDA device for the nccl backend, else NumPy."""
    if like.cuda:
        import torch

        return torch.zeros(size, dtype=torch.int64, device=like.device)
    return _numpy().zeros(size, dtype=_numpy().int64)


# ------------------------------------------------------------------- worker


@dataclass
class DispatchOutput:
    """What dispatch returns (SGLang's dispatch output, for EP = world_size).

    hidden_states [E, R, H] bf16, topk_ids [E, R, K] int32 (global ids; the
    invalid id on padding slots), topk_weights [E, R, K] float32: row s holds
    the tokens source rank s sent here in slots [0, num_recv_tokens_per_source[s]);
    num_recv_tokens_per_expert [L] int64: (token, choice) pairs per local
    expert; num_recv_tokens_per_source [E] int64. On the nccl backend all
    five are CUDA tensors (the counts too, computed on the device).
    """

    hidden_states: Any
    topk_ids: Any
    topk_weights: Any
    num_recv_tokens_per_expert: Any
    num_recv_tokens_per_source: Any
    # (recv_rows, torch?, addresses): what dispatch(out=...) writes into.
    _pointers: Any = field(default=None, repr=False, compare=False)


class _DeviceArray:
    """Device memory torch.as_tensor can view (__cuda_array_interface__,
    version 3): C-contiguous `shape` of `typestr` at `address`; owns nothing."""

    def __init__(self, address: int, shape: Tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (address, False), "strides": None,
                                         "version": 3}


_F = TypeVar("_F", bound=Callable[..., Any])


def _timeout_ms(timeout_s: Any) -> int:
    """A data call's slot wait in ms (0 = no limit). Checked here, before the
    call: the library refuses a negative timeout before the call's round,
    where the peers would be left waiting for this rank."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not timeout_s >= 0:
        raise ValueError(f"timeout_s: expected seconds >= 0 (0 = no limit), got {timeout_s!r}")
    return 0 if timeout_s == 0 else max(1, int(timeout_s * 1000))  # never "no limit" by rounding

def _plain_timeout_ms(timeout_s: Any) -> Optional[int]:
    """_timeout_ms of a plain int or float in [0, 1e9) s, else None (the
    checked path then checks it and names it): the one-pass calls'."""
    kind = type(timeout_s)
    if (kind is not float and kind is not int) or not 0 <= timeout_s < 1e9:
        return None
    return 0 if timeout_s == 0 else max(1, int(timeout_s * 1000))


# The data calls Worker.refuse enters, by C name.
_REFUSABLE = ("moe_ep_sync_token_counts", "moe_ep_dispatch", "moe_ep_dispatch_only",
              "moe_ep_combine", "moe_ep_forward")


def _refused_on_error(call: str) -> Callable[[_F], _F]:
    """A Worker data call whose checks raise before the C call was made
    (self._calls unchanged) refuses `call` in its round (Worker.refuse),
    then raises the checks' error."""

    def decorate(method: _F) -> _F:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def wrapper(self: "Worker", *args: Any, **kwargs: Any) -> Any:
            made = self._calls
            try:
                return method(self, *args, **kwargs)
            except Exception:
                if self._calls == made:
                    # timeout_s passed by keyword or by position alike.
                    try:
                        bound = signature.bind(self, *args, **kwargs).arguments
                    except TypeError:
                        bound = {}
                    self.refuse(call, bound.get("timeout_s", 0.0))
                raise

        return wrapper  # type: ignore[return-value]

    return decorate


class _LiveCalls:
    """The library's calls on a Worker's handle: `calls.moe_ep_x(args...)`
    runs moe_ep_x(handle, args...) while counted in flight, so that
    Worker.stop() frees the handle only once no other thread is inside a call
    (server/moe_ep.h: moe_ep_worker_stop must not race with other calls).
    ValueError "worker: stopped" once stop() began."""

    def __init__(self, worker: "Worker") -> None:
        self._worker = worker

    def __getattr__(self, name: str) -> Callable[..., int]:
        fn = getattr(self._worker._lib, name)
        w = self._worker

        def call(*args: Any) -> int:
            handle = w._enter()
            if handle is None:
                raise ValueError("worker: stopped")
            try:
                return fn(handle, *args)
            finally:
                w._leave()

        # Made once per name: later lookups find the attribute and skip
        # __getattr__ (the data calls' hot path).
        setattr(self, name, call)
        return call


class Worker:
    """A worker started in this process (moe_ep_worker_start): `args` are
    moe-ep-worker's flags. Stop it with stop() or a `with` block."""

    def __init__(self, args: Sequence[str] = (), library: Optional[str] = None):
        self._lib = load_library(library)
        for i, a in enumerate(args):
            if not isinstance(a, str):
                raise TypeError(f"args[{i}]: expected str, got {type(a).__name__}")
        argv = (ctypes.c_char_p * max(len(args), 1))(*[a.encode() for a in args])
        handle = ctypes.c_void_p()
        _check(self._lib, "moe_ep_worker_start",
               self._lib.moe_ep_worker_start(len(args), argv, ctypes.byref(handle)))
        self._handle = handle
        address = ctypes.c_char_p()
        _check(self._lib, "moe_ep_worker_address",
               self._lib.moe_ep_worker_address(self._handle, ctypes.byref(address)))
        self.address: str = address.value.decode()
        self._info: Optional[WorkerInfo] = None
        # The dispatched step combine() completes (None: none known here).
        self._step_tokens: Optional[int] = None
        self._step_recv_rows: Optional[int] = None
        # Data calls made into the library (a check that raised made none).
        self._calls = 0
        # Library calls on the handle now running on any thread (_LiveCalls).
        # (A plain lock: the data calls' hot path takes it twice.)
        self._state = threading.Lock()
        self._in_flight = 0
        self._drained = threading.Event()  # set once stop() found no call in flight
        self._c = _LiveCalls(self)

    def _enter(self) -> Any:
        """A library call on the handle begins: counted in flight, so that
        stop() frees the handle only once no other thread is inside a call
        (server/moe_ep.h: moe_ep_worker_stop must not race with other
        calls). -> the handle, or None (counted nothing) once stop() began.
        Every non-None return is paired with _leave()."""
        with self._state:
            handle = self._handle
            if handle is not None:
                self._in_flight += 1
            return handle

    def _leave(self) -> None:
        with self._state:
            self._in_flight -= 1
            # Only stop() waits, and it clears the handle first.
            if self._handle is None and self._in_flight == 0:
                self._drained.set()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _live(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise ValueError("worker: stopped")
        return self._handle

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stops the worker: calls from now on raise ValueError "worker:
        stopped"; waits for this module's calls already running on other
        threads to return (each is bounded by its timeout or the group's);
        then drains running RPCs (up to drain_timeout_s), stops serving and
        frees the worker. A second stop does nothing. Never waits on CUDA
        graphs that captured this worker's calls: on the NCCL plane, where
        they still exist, NCCL's communicator is freed in the background
        once they are destroyed (del them first to free it at once); never
        replay such a graph after stop."""
        with self._state:
            if self._handle is None:
                return
            handle, self._handle = self._handle, None
            if self._in_flight == 0:
                self._drained.set()
        self._drained.wait()
        _check(self._lib, "moe_ep_worker_stop",
               self._lib.moe_ep_worker_stop(handle, int(drain_timeout_s * 1000)))

    def noop(self) -> None:
        """One call of the C no-op through this wrapper's checks (overhead figure)."""
        self._live()
        _check(self._lib, "moe_ep_noop", self._lib.moe_ep_noop())

    def refuse(self, call: str, timeout_s: float = 0.0) -> Optional["EngineError"]:
        """Takes part in the opening round of data call `call` (a C name:
        "moe_ep_sync_token_counts", "moe_ep_dispatch", "moe_ep_dispatch_only",
        "moe_ep_combine", "moe_ep_forward") refusing it, for a rank that cannot
        make the call its peers are making (its own inputs failed a check):
        on the CPU (gloo) plane every data call opens with one round that
        pairs the ranks' calls (core/engine_call_round.h), and a refusal there
        returns the peers' calls at once with EngineError ABORTED naming this
        rank ("rank r refused its moe_ep_dispatch (INVALID_ARGUMENT) ...;
        nothing moved, the group is still usable"). Returns this rank's
        EngineError from the library (its own refusal), or None where there
        is nothing to enter: a stopped or not yet allocated worker, a GPU
        plane's sync_token_counts / dispatch_only (no round there). On a GPU
        plane a refused moe_ep_dispatch or moe_ep_forward is enqueued on the
        current torch stream: the one-sided plane publishes the refusal, the
        nccl plane runs the step's transfers with a header marked refused, so
        on both the peers' step ends at once and their check_step names this
        rank (server/moe_ep.h); so is a refused moe_ep_combine (flags marked
        refused on one-sided, a header marked refused among the combine's
        transfers on nccl). Never raises except ValueError for an unknown
        `call`. The data calls of this module call it themselves when their
        checks fail."""
        if call not in _REFUSABLE:
            raise ValueError(f"call: expected one of {', '.join(_REFUSABLE)}, got {call!r}")
        try:
            info = self.info()
        except Exception:  # stopped, or not allocated: nothing to enter
            return None
        backend = info.backend
        try:
            ms = _timeout_ms(timeout_s)
        except ValueError:  # the call's own bad timeout: still meet the peers
            ms = 0
        stream = None
        if backend != "gloo":
            if call not in ("moe_ep_dispatch", "moe_ep_forward", "moe_ep_combine"):
                return None
            if _current_raw_stream is not None and info.device >= 0:
                stream = _current_raw_stream(info.device) or None
        lib, c = self._lib, self._c
        # Arguments every plane refuses in the round: num_tokens / rows = -1.
        try:
            if call == "moe_ep_sync_token_counts":
                status = c.moe_ep_sync_token_counts(-1, None, None)
            elif call == "moe_ep_combine":
                status = c.moe_ep_combine(None, -1, None, stream, ms)
            elif call == "moe_ep_forward":
                status = c.moe_ep_forward(0, None, None, None, -1, None, stream, ms)
            else:
                fn = c.moe_ep_dispatch_only if call == "moe_ep_dispatch_only" else c.moe_ep_dispatch
                status = fn(None, None, None, -1, None, None, None, 0, None, None, stream, ms)
        except ValueError:  # stopped meanwhile
            return None
        self._calls += 1
        if status == 0:  # not reachable: -1 tokens is always refused
            return None
        return EngineError(call, status, lib.moe_ep_last_error().decode(errors="replace"))

    def wait_ready(self, timeout_s: float = 60.0, experts: str = "worker") -> None:
        """The readiness contract of the data calls (moe_ep_worker_wait_ready_for_steps,
        issue 30): blocks until the orchestrator has formed, configured and
        allocated the group on every rank and, with experts="worker" (the
        default: the engine calls forward), loaded every sparse layer of the
        plan on every rank; experts="own" (the engine runs its own experts:
        dispatch / combine only) does not wait for experts. Every rank calls
        it; it returns on all of them together, and data calls before it
        raise EngineError FAILED_PRECONDITION. Call it again after the group
        re-formed or the workspace was re-allocated. timeout_s > 0; on
        timeout EngineError DEADLINE_EXCEEDED says what this rank lacks or
        which ranks did not agree."""
        if experts not in _STEP_EXPERTS:
            raise ValueError(f"experts: expected 'worker' or 'own', got {experts!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s!r}")
        _check(self._lib, "moe_ep_worker_wait_ready_for_steps",
               self._c.moe_ep_worker_wait_ready_for_steps(_STEP_EXPERTS[experts],
                                                          max(1, int(timeout_s * 1000))))
        self._info = None

    def wait_configured(self, timeout_s: float = 60.0) -> None:
        """Blocks until this rank's control plane is set up (moe_ep_worker_wait_ready:
        joined, allocated, not broken). Not the readiness for data calls: wait_ready."""
        _check(self._lib, "moe_ep_worker_wait_ready",
               self._c.moe_ep_worker_wait_ready(int(timeout_s * 1000)))
        self._info = None

    def info(self, refresh: bool = False) -> WorkerInfo:
        """The allocated group (cached; refresh=True asks the worker again)."""
        self._live()  # a stopped worker has no group to describe
        if self._info is None or refresh:
            s = _WorkerInfoStruct()
            s.struct_size = ctypes.sizeof(_WorkerInfoStruct)
            _check(self._lib, "moe_ep_worker_info_get",
                   self._c.moe_ep_worker_info_get(ctypes.byref(s)))
            self._info = WorkerInfo(
                rank=s.rank, world_size=s.world_size, generation=s.generation, hidden=s.hidden,
                top_k=s.top_k, num_experts=s.num_experts, first_expert=s.first_expert,
                num_local_experts=s.num_local_experts, capacity_tokens=s.capacity_tokens,
                invalid_expert_id=s.invalid_expert_id, backend=_BACKENDS.get(s.backend, "?"),
                epoch=s.epoch, runtime_max_tokens_per_rank=s.runtime_max_tokens_per_rank,
                device=s.device)
        return self._info

    def _group(self, call: str) -> WorkerInfo:
        """info() for data call `call`: before the group is allocated its
        error names `call` (not moe_ep_worker_info_get) and the wait."""
        try:
            return self.info()
        except EngineError as e:
            raise EngineError(call, e.status, f"{e.message} (no allocated group yet: "
                                              f"wait_ready() returns once there is one)") from e

    @_refused_on_error("moe_ep_sync_token_counts")
    def sync_token_counts(self, local_tokens: int) -> Tuple[List[int], int]:
        """All ranks' token counts and the step's R (collective)."""
        if not isinstance(local_tokens, int) or isinstance(local_tokens, bool) or local_tokens < 0:
            raise ValueError(f"local_tokens: expected an int >= 0, got {local_tokens!r}")
        info = self._group("moe_ep_sync_token_counts")
        counts = (ctypes.c_int64 * info.world_size)()
        r = ctypes.c_int64()
        self._calls += 1
        _check(self._lib, "moe_ep_sync_token_counts",
               self._c.moe_ep_sync_token_counts(local_tokens, ctypes.addressof(counts),
                                                ctypes.addressof(r)))
        return list(counts), int(r.value)

    def sync_token_counts_async(self, local_tokens: Any) -> Any:
        """nccl: the token-count agreement on the device (collective, enqueued on
        the current stream, capturable): local_tokens a CUDA int64 tensor of
        one element -> counts, a CUDA int64 tensor [E]."""
        info = self._group("moe_ep_sync_token_counts_async")
        t = _buffer("local_tokens", local_tokens, "int64", (1,), True, info.device)
        counts = _counts(t, info.world_size)
        _check(self._lib, "moe_ep_sync_token_counts_async",
               self._c.moe_ep_sync_token_counts_async(t.ptr, _ptr(counts), _stream(t), 0))
        return counts

    def check_step(self, timeout_s: float = 0.0) -> None:
        """nccl: the sync point (waits for the enqueued calls; raises EngineError
        ABORTED when ranks disagreed on (epoch, R)). Not capturable."""
        _check(self._lib, "moe_ep_check_step",
               self._c.moe_ep_check_step(int(timeout_s * 1000)))

    def graph_token(self) -> int:
        """The workspace's token: record it when capturing a CUDA graph."""
        token = ctypes.c_uint64()
        _check(self._lib, "moe_ep_graph_token",
               self._c.moe_ep_graph_token(ctypes.byref(token)))
        return int(token.value)

    def check_graph(self, token: int) -> bool:
        """True when a graph captured under `token` may be replayed; False when
        the group re-formed or the workspace was re-allocated since (capture
        again). Raises EngineError otherwise (e.g. the group is broken)."""
        status = self._c.moe_ep_check_graph(int(token))
        if status == _RECAPTURE:
            return False
        _check(self._lib, "moe_ep_check_graph", status)
        return True

    def receive_buffers(self) -> Tuple[int, int, int, int]:
        """One-sided plane, workers started with --onesided-receive-buffers:
        (recv_rows, hidden, topk_ids, topk_weights), the device addresses of
        the dispatch buffers inside this rank's window ([E, recv_rows, H]
        bf16, [E, recv_rows, K] int32 and fp32; recv_rows = capacity N).
        A dispatch into them at R <= 512 has the peers store their rows in
        place (server/moe_ep.h moe_ep_receive_buffers says when, and what
        every rank must do alike). Raises EngineError UNIMPLEMENTED on the
        gloo and nccl planes or without the flag."""
        hidden, ids, weights = _P(), _P(), _P()
        rows = _I64()
        _check(self._lib, "moe_ep_receive_buffers",
               self._c.moe_ep_receive_buffers(ctypes.byref(hidden), ctypes.byref(ids),
                                              ctypes.byref(weights), ctypes.byref(rows)))
        return (int(rows.value), int(hidden.value or 0), int(ids.value or 0),
                int(weights.value or 0))

    def receive_output(self) -> DispatchOutput:
        """torch: a DispatchOutput whose hidden_states [E, N, H] bf16,
        topk_ids [E, N, K] int32 and topk_weights [E, N, K] float32 are CUDA
        tensors over this rank's receive buffers (receive_buffers()), with
        count tensors of its own. Pass it as dispatch(..., recv_rows=N,
        out=...): the peers then store their rows in place at R <= 512, as
        DeepEP's low-latency receive tensors live in its buffer. The tensors
        do not own the memory: valid while graph_token() is unchanged, and
        the next dispatch overwrites them (server/moe_ep.h says when a
        peer's may). Raises EngineError as receive_buffers(), ImportError
        without torch."""
        import torch

        rows, hidden, ids, weights = self.receive_buffers()
        info = self.info(refresh=True)
        device = torch.device("cuda", info.device)
        e, k = info.world_size, info.top_k

        def over(address: int, shape: Tuple[int, ...], typestr: str) -> Any:
            return torch.as_tensor(_DeviceArray(address, shape, typestr), device=device)

        out = DispatchOutput(
            over(hidden, (e, rows, info.hidden), "<i2").view(torch.bfloat16),
            over(ids, (e, rows, k), "<i4"), over(weights, (e, rows, k), "<f4"),
            torch.zeros(info.num_local_experts, dtype=torch.int64, device=device),
            torch.zeros(e, dtype=torch.int64, device=device))
        out._pointers = (rows, True, hidden, ids, weights, _ptr(out.num_recv_tokens_per_expert),
                         _ptr(out.num_recv_tokens_per_source))
        return out

    def commit_geometry(self, epoch: int, runtime_max_tokens_per_rank: int, local_tokens: int) -> None:
        """Commits (epoch, R) for the next steps; every rank commits the same pair."""
        _check(self._lib, "moe_ep_commit_geometry",
               self._c.moe_ep_commit_geometry(epoch, runtime_max_tokens_per_rank, local_tokens))

    def _inputs(self, hidden: Any, topk_ids: Any, topk_weights: Any,
                call: str = "moe_ep_dispatch",
                info: Optional[WorkerInfo] = None
                ) -> Tuple[_Buffer, Optional[int], Optional[int]]:
        """The checked inputs of a dispatch or forward: hidden's _Buffer and
        the addresses of topk_ids and topk_weights."""
        if info is None:
            info = self._group(call)
        cuda = info.backend == "nccl"
        if cuda:
            fast = _torch_inputs(hidden, topk_ids, topk_weights, info)
            if fast is not None:
                return fast
        d = info.device
        h = _buffer("hidden_states", hidden, "bf16", (None, info.hidden), cuda, d)
        t = h.shape[0]
        ids = _buffer("topk_ids", topk_ids, "int32", (t, info.top_k), cuda, d)
        w = _buffer("topk_weights", topk_weights, "float32", (t, info.top_k), cuda, d)
        return h, ids.ptr, w.ptr

    def dispatch(self, hidden_states: Any, topk_ids: Any, topk_weights: Any,
                 recv_rows: Optional[int] = None, timeout_s: float = 0.0,
                 out: Optional[DispatchOutput] = None, end_step: bool = False) -> DispatchOutput:
        made = self._calls
        try:
            if out is not None and end_step is False:
                done = self._dispatch_fast(hidden_states, topk_ids, topk_weights, recv_rows,
                                           timeout_s, out)
                if done is not None:
                    return done
            return self._dispatch(hidden_states, topk_ids, topk_weights, recv_rows, timeout_s, out,
                                  end_step)
        except Exception:
            if self._calls == made:
                self.refuse("moe_ep_dispatch_only" if end_step is True else "moe_ep_dispatch",
                            timeout_s)
            raise

    def _dispatch_fast(self, x: Any, ids: Any, w: Any, recv_rows: Any, timeout_s: Any,
                       out: DispatchOutput) -> Optional[DispatchOutput]:
        """A CUDA engine's steady-state dispatch in one pass (issue 30 item 3:
        the Python layer's host time over the C call): exact torch.Tensors
        of bf16 [T, H] / int32 [T, K] / float32 [T, K], C-contiguous, into
        `out` of an earlier dispatch with the same recv_rows, timeout_s a
        number in [0, 1e9). The tensors' device is left to the library's
        pointer check (server/gpu_engine_args.h names the argument and the
        worker's device). None, having called nothing, when anything differs
        or the worker is stopped: then _dispatch checks and names it."""
        info, fast, ptrs = self._info, _TORCH_FAST, getattr(out, "_pointers", None)
        if (fast is None or info is None or info.backend != "nccl" or ptrs is None
                or type(recv_rows) is not int or recv_rows != ptrs[0] or ptrs[1] is not True):
            return None
        tensor, bf16, int32, float32, raw_stream = fast
        if (type(x) is not tensor or type(ids) is not tensor or type(w) is not tensor
                or x.dtype is not bf16 or ids.dtype is not int32 or w.dtype is not float32):
            return None
        shape = x.shape
        if len(shape) != 2 or shape[1] != info.hidden:
            return None
        t = shape[0]
        choices = (t, info.top_k)
        if (ids.shape != choices or w.shape != choices or not x.is_contiguous()
                or not ids.is_contiguous() or not w.is_contiguous()):
            return None
        ms = _plain_timeout_ms(timeout_s)
        if ms is None:
            return None
        # No empty tensor (its address is 0: the checked path refuses a host
        # one, which the library's check could not see).
        hp, ip, wp = x.data_ptr(), ids.data_ptr(), w.data_ptr()
        if not hp or not ip or not wp:
            return None
        stream = raw_stream(info.device) or None
        handle = self._enter()
        if handle is None:
            return None
        self._calls += 1
        try:
            status = self._lib.moe_ep_dispatch(handle, hp, ip, wp, t, ptrs[2], ptrs[3], ptrs[4],
                                               recv_rows, ptrs[6], ptrs[5], stream, ms)
        finally:
            self._leave()
        if status:
            _check(self._lib, "moe_ep_dispatch", status)
        self._step_tokens, self._step_recv_rows = t, recv_rows
        return out

    def _dispatch(self, hidden_states: Any, topk_ids: Any, topk_weights: Any,
                  recv_rows: Optional[int], timeout_s: float, out: Optional[DispatchOutput],
                  end_step: bool) -> DispatchOutput:
        """Dispatch of a committed step (collective): see DispatchOutput.
        recv_rows (>= R; default: the committed R) sizes the outputs' R axis.
        out: a DispatchOutput of an earlier dispatch with the same recv_rows
        and kind of tensor, written again instead of allocating (its arrays
        then hold this step's rows). end_step: an exchange
        (moe_ep_dispatch_only, gloo): the step ends here, no combine follows;
        every rank passes the same value."""
        info = self._group("moe_ep_dispatch_only" if end_step else "moe_ep_dispatch")
        h, ids, w = self._inputs(hidden_states, topk_ids, topk_weights, info=info)
        if recv_rows is None:
            recv_rows = self.info(refresh=True).runtime_max_tokens_per_rank
        elif not isinstance(recv_rows, int) or recv_rows < 0:
            raise ValueError(f"recv_rows: expected an int >= 0, got {recv_rows!r}")
        rows = recv_rows
        if out is None:
            e, k = info.world_size, info.top_k
            out = DispatchOutput(
                _empty(h, (e, rows, info.hidden), "bf16"), _empty(h, (e, rows, k), "int32"),
                _empty(h, (e, rows, k), "float32"), _counts(h, info.num_local_experts),
                _counts(h, e))
            out._pointers = (rows, h.torch, _ptr(out.hidden_states), _ptr(out.topk_ids),
                             _ptr(out.topk_weights), _ptr(out.num_recv_tokens_per_expert),
                             _ptr(out.num_recv_tokens_per_source))
        pointers = getattr(out, "_pointers", None)
        if pointers is None or pointers[0] != rows or pointers[1] != h.torch:
            raise ValueError(
                f"out: expected a DispatchOutput of a dispatch with recv_rows {rows} and "
                f"{'torch tensors' if h.torch else 'NumPy arrays'}")
        call = self._c.moe_ep_dispatch_only if end_step else self._c.moe_ep_dispatch
        stream = _stream(h) if h.cuda else None
        ms = _timeout_ms(timeout_s)
        self._calls += 1
        status = call(
            h.ptr, ids, w, h.shape[0], pointers[2], pointers[3], pointers[4],
            rows, pointers[6], pointers[5], stream, ms)
        if status:
            _check(self._lib, "moe_ep_dispatch_only" if end_step else "moe_ep_dispatch", status)
        # A dispatch that ends the step (end_step) leaves nothing to combine.
        self._step_tokens = None if end_step else h.shape[0]
        self._step_recv_rows = None if end_step else rows
        return out

    def combine(self, expert_outputs: Any, timeout_s: float = 0.0, out: Any = None) -> Any:
        """Combine of the dispatched step (collective): expert_outputs [E, recv_rows, H]
        bf16 -> [T, H] bf16 (T of the dispatch), written into `out` when given
        (a C-contiguous [T, H] bf16 array or tensor of the same kind and
        device as expert_outputs; DeepEP's low_latency_combine takes one too)
        and returned."""
        made = self._calls
        try:
            if out is not None:
                done = self._combine_fast(expert_outputs, timeout_s, out)
                if done is not None:
                    return done
            return self._combine(expert_outputs, timeout_s, out)
        except Exception:
            if self._calls == made:
                self.refuse("moe_ep_combine", timeout_s)
            raise

    def _combine_fast(self, x: Any, timeout_s: Any, out: Any) -> Any:
        """A CUDA engine's steady-state combine in one pass (issue 30 item 3),
        as _dispatch_fast: exact torch.Tensors, expert_outputs bf16 [E,
        recv_rows, H] and out bf16 [T, H] of the dispatched step, both
        C-contiguous, the device left to the library's check. None, having
        called nothing, when anything differs: then _combine checks."""
        info, fast = self._info, _TORCH_FAST
        rows, tokens = self._step_recv_rows, self._step_tokens
        if fast is None or info is None or info.backend != "nccl" or rows is None or tokens is None:
            return None
        tensor, bf16 = fast[0], fast[1]
        if (type(x) is not tensor or type(out) is not tensor or x.dtype is not bf16
                or out.dtype is not bf16 or x.shape != (info.world_size, rows, info.hidden)
                or out.shape != (tokens, info.hidden) or not x.is_contiguous()
                or not out.is_contiguous()):
            return None
        ms = _plain_timeout_ms(timeout_s)
        if ms is None:
            return None
        xp, op = x.data_ptr(), out.data_ptr()
        if not xp or not op:  # an empty tensor: the checked path's (as _dispatch_fast)
            return None
        stream = fast[4](info.device) or None
        handle = self._enter()
        if handle is None:
            return None
        self._calls += 1
        try:
            status = self._lib.moe_ep_combine(handle, xp, rows, op, stream, ms)
        finally:
            self._leave()
        # A failed combine ends the step on the GPU planes too (_combine).
        self._step_tokens = self._step_recv_rows = None
        if status:
            _check(self._lib, "moe_ep_combine", status)
        return out

    def _combine(self, expert_outputs: Any, timeout_s: float, out: Any) -> Any:
        """combine() with every argument checked by name (combine refuses the
        call in its round when a check raises)."""
        info = self._group("moe_ep_combine")
        cuda = info.backend == "nccl"
        rows, tokens = self._step_recv_rows, self._step_tokens
        if rows is None or tokens is None:
            # No dispatched step here (none yet, or the last one was
            # combined): the library still meets the peers in the call's
            # opening round and refuses it there ("combine needs a dispatch
            # first"), so every rank's calls stay paired.
            shape = tuple(getattr(expert_outputs, "shape", ()))
            rows, tokens = (int(shape[1]) if len(shape) == 3 else 0), 0
        shape = (info.world_size, rows, info.hidden)
        fast = _torch_address(expert_outputs, "bf16", shape, info.device) if cuda else False
        if fast is not False:
            x = _Buffer(fast, shape, True, True, info.device)
        else:
            x = _buffer("expert_outputs", expert_outputs, "bf16", shape, cuda, info.device)
        if out is None:
            out = _empty(x, (tokens, info.hidden), "bf16")
            ptr = _ptr(out)
        elif self._step_tokens is None:
            ptr = None  # no step: the library refuses the call, naming the order
        else:
            ptr = (_torch_address(out, "bf16", (tokens, info.hidden), info.device)
                   if x.torch and x.cuda else False)
            if ptr is False:
                o = _buffer("out", out, "bf16", (tokens, info.hidden), cuda, info.device,
                            written=True)
                if o.torch != x.torch:
                    raise TypeError("out: expected the same kind of array as expert_outputs "
                                    f"({'a torch tensor' if x.torch else 'a NumPy array'})")
                ptr = o.ptr
        stream, ms = _stream(x), _timeout_ms(timeout_s)
        self._calls += 1
        status = self._c.moe_ep_combine(x.ptr, rows, ptr, stream, ms)
        if not status or info.backend != "gloo":
            # A failed combine ends the step on the GPU planes (refused in
            # place); the CPU plane keeps it dispatched (call again).
            self._step_tokens = self._step_recv_rows = None
        if status:
            _check(self._lib, "moe_ep_combine", status)
        return out

    @_refused_on_error("moe_ep_forward")
    def forward(self, layer: int, hidden_states: Any, topk_ids: Any, topk_weights: Any,
                timeout_s: float = 0.0) -> Any:
        """One MoE layer with the worker's loaded experts (collective): -> [T, H] bf16."""
        if not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer: expected an int >= 0, got {layer!r}")
        h, ids, w = self._inputs(hidden_states, topk_ids, topk_weights, "moe_ep_forward")
        out = _empty(h, h.shape, "bf16")
        ptr = _ptr(out)
        stream, ms = _stream(h), _timeout_ms(timeout_s)
        self._calls += 1
        _check(self._lib, "moe_ep_forward", self._c.moe_ep_forward(
            layer, h.ptr, ids, w, h.shape[0], ptr, stream, ms))
        return out


class Dispatcher:
    """Shaped like SGLang's token dispatchers, over an embedded Worker: each
    dispatch() agrees the token counts (sync_token_counts), commits the next
    epoch's geometry and dispatches; combine() returns [T, H]. Every rank
    calls dispatch and combine in the same order.

    reuse_outputs: keep one DispatchOutput per R and write it again at the
    next dispatch with that R (no allocation; like DeepEP's buffers, an output
    is then valid only until the next dispatch).

    graph_bucket (nccl, CUDA graphs): commits (first_epoch, graph_bucket)
    once, here, and every dispatch() then only enqueues (no host agreement,
    R = the bucket), so dispatch, the caller's experts and combine can be
    captured in a torch CUDA graph and replayed; T <= graph_bucket (pad with
    the invalid expert id). Outputs are reused (a graph's buffers stay put).
    graph_token() taken at capture and worker.check_graph(token) before a
    replay say whether the graph is still valid (False after the group
    re-formed: capture again). Every rank passes the same bucket."""

    def __init__(self, worker: Worker, first_epoch: int = 1, reuse_outputs: bool = False,
                 graph_bucket: Optional[int] = None):
        self.worker = worker
        self._epoch = first_epoch
        self._reuse = reuse_outputs or graph_bucket is not None
        self._outputs: dict = {}
        self._bucket = graph_bucket
        if graph_bucket is not None:
            if not isinstance(graph_bucket, int) or graph_bucket < 1:
                raise ValueError(f"graph_bucket: expected an int >= 1, got {graph_bucket!r}")
            worker.commit_geometry(first_epoch, graph_bucket, 0)

    def graph_token(self) -> int:
        """The worker's workspace token (Worker.graph_token)."""
        return self.worker.graph_token()

    def dispatch(self, hidden_states: Any, topk_ids: Any, topk_weights: Any) -> DispatchOutput:
        try:  # checks before any call; on error this rank refuses its first call
            self.worker._inputs(hidden_states, topk_ids, topk_weights)
            tokens = int(hidden_states.shape[0])
            if self._bucket is not None and tokens > self._bucket:
                raise ValueError(
                    f"hidden_states: {tokens} tokens, more than graph_bucket {self._bucket}")
        except Exception:
            self.worker.refuse(
                "moe_ep_dispatch" if self._bucket is not None else "moe_ep_sync_token_counts")
            raise
        if self._bucket is not None:
            r = self._bucket
        else:
            _, r = self.worker.sync_token_counts(tokens)
            self.worker.commit_geometry(self._epoch, r, tokens)
            self._epoch += 1
        key = (r, _is_torch(hidden_states))
        out = self.worker.dispatch(hidden_states, topk_ids, topk_weights, recv_rows=r,
                                   out=self._outputs.get(key))
        if self._reuse:
            self._outputs[key] = out
        return out

    def combine(self, hidden_states: Any) -> Any:
        return self.worker.combine(hidden_states)
