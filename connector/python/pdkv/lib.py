# SPDX-License-Identifier: Apache-2.0
"""ctypes binding of libkvconnector (include/kvconnector.h).

The library is found, in this order, at:
  1. $PDKV_LIBRARY (a path to libkvconnector.so),
  2. this package's folder (a wheel that ships the .so beside it),
  3. the dynamic loader's path (ldconfig, LD_LIBRARY_PATH): libkvconnector.so.0.
library_path() names the file loaded; a failure (LibraryNotFoundError, an
OSError) names every place tried.

Agent wraps one kvc_agent_t.  Every call takes the agent's lock; with
start() a progress thread waits on the agent's fd, calls
kvc_agent_progress() and hands each Event to a callback, so loads and
notifications advance while the engine runs its forward pass.  ctypes
releases the GIL during C calls.  The library's log lines go to the Python
logger "pdkv.kvc" (levels mapped: error, warning, info, debug); its level
decides which lines the library formats at all (KVC_LOG_LEVEL, if set,
overrides).

Statuses, events, log levels and stats are IntEnums, field masks IntFlags,
with the header's values; a failed call raises the KvcError subclass of its
status (e.g. DeniedError for KVC_ERR_DENIED).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import enum
import logging
import os
import select
import threading
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["Agent", "Event", "EventType", "Status", "Stat", "LogLevel", "AgentField",
           "RegionField", "MemType", "PublishField", "FetchField", "KvcError",
           "LibraryNotFoundError", "InvalidParamError", "UnreachableError", "KvcTimeoutError",
           "NotFoundError", "ExistsError", "DeniedError", "AuthError", "BusyError",
           "StateError", "IncompatibleError", "load_library", "library_path", "new_token",
           "status_str"]

log = logging.getLogger("pdkv.kvc")


class Status(enum.IntEnum):
    """kvc_status_t."""
    OK = 0
    INPROGRESS = 1
    AGAIN = 2
    ERR_NO_MEMORY = -1
    ERR_INVALID_PARAM = -2
    ERR_UNREACHABLE = -3
    ERR_TIMED_OUT = -4
    ERR_VERSION = -5
    ERR_INCOMPATIBLE = -6
    ERR_NOT_FOUND = -7
    ERR_EXISTS = -8
    ERR_PROTOCOL = -9
    ERR_PEER_FAILED = -10
    ERR_CANCELED = -11
    ERR_TRANSPORT = -12
    ERR_IO = -13
    ERR_UNSUPPORTED = -14
    ERR_NO_DEVICE = -15
    ERR_STATE = -16
    ERR_AUTH = -17
    ERR_DENIED = -18
    ERR_CUDA = -19
    ERR_BUSY = -20


class EventType(enum.IntEnum):
    """kvc_event_type_t."""
    FETCH_DONE = 1
    FETCH_FAILED = 2
    RELEASED = 3
    EXPIRED = 4
    UNKNOWN_NOTIFY = 5


class LogLevel(enum.IntEnum):
    """kvc_log_level_t."""
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3


class Stat(enum.IntEnum):
    """kvc_stat_t."""
    PUBLISHED = 0
    RELEASED = 1
    EXPIRED = 2
    UNKNOWN_NOTIFY = 3
    FETCH_DONE = 4
    FETCH_FAILED = 5
    BYTES_FETCHED = 6
    HANDSHAKES = 7
    PUBLISHED_NOW = 8
    AUTHENTICATED = 9
    AUTH_FAILED = 10
    DENIED = 11
    PEER_ERRORS = 12
    CUDA_DIRECT_REGIONS = 13
    CUDA_STAGED_REGIONS = 14
    PEERS_GET = 15
    PEERS_PUSH = 16
    TRANSPORTS = 17
    CUDA_COPIES = 18
    CUDA_SYNCS = 19
    PENDING_FETCHES = 20
    PENDING_SERVED = 21
    PENDING_EXPIRED = 22
    PENDING_REFUSED = 23
    LEASE_RENEWALS = 24
    LEASE_EXPIRED = 25
    FETCH_CANCELED = 26
    CONSUMERS_LOST = 27
    PEERS_IPC = 28
    BYTES_IPC = 29
    FETCH_STAGED_SHM = 30
    FETCH_STAGED_WIRE = 31


class AgentField(enum.IntFlag):
    ENGINE_ID = 1 << 0
    LISTEN_HOST = 1 << 1
    LISTEN_PORT = 1 << 2
    ADVERTISE_HOST = 1 << 3
    LOG = 1 << 4
    CONNECT_TIMEOUT = 1 << 5
    EXPIRY = 1 << 6
    XFER_TIMEOUT = 1 << 7
    LAYOUT_TAG = 1 << 8
    TP_SIZE = 1 << 9
    PROTO = 1 << 10
    LOG_LEVEL = 1 << 11
    SECRET = 1 << 12
    MAX_HANDSHAKES = 1 << 13
    STAGING_POOL = 1 << 14
    PROGRESS_THREAD = 1 << 15
    LEASE = 1 << 16
    PENDING_FETCH = 1 << 17


class RegionField(enum.IntFlag):
    BASE = 1 << 0
    MEM_TYPE = 1 << 1
    CUDA_DEVICE = 1 << 2


class MemType(enum.IntEnum):
    HOST = 0
    CUDA = 1


class PublishField(enum.IntFlag):
    EXPIRY = 1 << 0
    USER_DATA = 1 << 1
    CONSUMERS = 1 << 2
    CUDA_EVENT = 1 << 3
    CUDA_STREAM = 1 << 4
    TOKEN = 1 << 5
    LEASE = 1 << 6


class FetchField(enum.IntFlag):
    JSON = 1 << 0
    REMOTE = 1 << 1
    LOCAL_BLOCKS = 1 << 2
    USER_DATA = 1 << 3
    CUDA_STREAM = 1 << 4
    SLICE = 1 << 5
    WAIT = 1 << 6
    REMOTE_RANK = 1 << 7


# ------------------------------------------------------------------ errors --
class KvcError(RuntimeError):
    """A kvc_ call failed: .call names the function, .status the kvc_status_t
    (a Status, or the raw int for a code this binding does not know)."""
    status: Union[Status, int] = 0

    def __init__(self, call: str, status: int, detail: str = ""):
        self.call = call
        self.status = _enum(Status, status)
        super().__init__(f"{call}: {status_str(status)}" + (f" ({detail})" if detail else ""))

    @staticmethod
    def of(call: str, status: int, detail: str = "") -> "KvcError":
        """The subclass for status (KvcError itself for the others)."""
        return _ERRORS.get(int(status), KvcError)(call, status, detail)


class LibraryNotFoundError(OSError):
    """libkvconnector was found nowhere; the message lists every place tried."""


class InvalidParamError(KvcError, ValueError):
    status = Status.ERR_INVALID_PARAM


class UnreachableError(KvcError, ConnectionError):
    status = Status.ERR_UNREACHABLE


class KvcTimeoutError(KvcError, TimeoutError):
    status = Status.ERR_TIMED_OUT


class IncompatibleError(KvcError):
    status = Status.ERR_INCOMPATIBLE


class NotFoundError(KvcError, LookupError):
    status = Status.ERR_NOT_FOUND


class ExistsError(KvcError):
    status = Status.ERR_EXISTS


class StateError(KvcError):
    status = Status.ERR_STATE


class AuthError(KvcError, PermissionError):
    status = Status.ERR_AUTH


class DeniedError(KvcError, PermissionError):
    status = Status.ERR_DENIED


class BusyError(KvcError):
    status = Status.ERR_BUSY


_ERRORS = {int(c.status): c for c in (InvalidParamError, UnreachableError, KvcTimeoutError,
                                      IncompatibleError, NotFoundError, ExistsError,
                                      StateError, AuthError, DeniedError, BusyError)}


def _enum(cls, value):
    try:
        return cls(value)
    except ValueError:
        return value


# ---------------------------------------------------------------- structs --
_LOG_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)


class AgentParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("engine_id", ctypes.c_char_p),
                ("listen_host", ctypes.c_char_p), ("listen_port", ctypes.c_uint16),
                ("advertise_host", ctypes.c_char_p), ("log_cb", _LOG_CB),
                ("log_arg", ctypes.c_void_p), ("log_level", ctypes.c_int),
                ("connect_timeout_ms", ctypes.c_uint32), ("expiry_ms", ctypes.c_uint32),
                ("xfer_timeout_ms", ctypes.c_uint32), ("layout_tag", ctypes.c_char_p),
                ("tp_size", ctypes.c_uint32), ("proto", ctypes.c_int),
                ("secret", ctypes.c_void_p), ("secret_len", ctypes.c_size_t),
                ("max_handshakes", ctypes.c_uint32), ("staging_pool_bytes", ctypes.c_size_t),
                ("progress_thread", ctypes.c_int), ("lease_ms", ctypes.c_uint32),
                ("pending_fetch_ms", ctypes.c_uint32), ("max_pending_fetches", ctypes.c_uint32),
                ("max_pending_per_peer", ctypes.c_uint32), ("max_pending_bytes", ctypes.c_size_t)]


class RegionParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("len", ctypes.c_size_t),
                ("base", ctypes.c_void_p), ("mem_type", ctypes.c_int),
                ("cuda_device", ctypes.c_int)]


class PublishParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("expiry_ms", ctypes.c_uint32),
                ("user_data", ctypes.c_uint64), ("consumers", ctypes.c_uint32),
                ("cuda_event", ctypes.c_void_p), ("cuda_stream", ctypes.c_void_p),
                ("kv_token", ctypes.c_char_p), ("lease_ms", ctypes.c_uint32)]


class FetchParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("kv_transfer_params_json", ctypes.c_char_p),
                ("remote_engine_id", ctypes.c_char_p), ("remote_request_id", ctypes.c_char_p),
                ("remote_host", ctypes.c_char_p), ("remote_port", ctypes.c_uint16),
                ("remote_block_ids", ctypes.POINTER(ctypes.c_uint64)),
                ("num_remote_blocks", ctypes.c_size_t),
                ("local_block_ids", ctypes.POINTER(ctypes.c_uint64)),
                ("num_local_blocks", ctypes.c_size_t), ("user_data", ctypes.c_uint64),
                ("remote_kv_token", ctypes.c_char_p), ("cuda_stream", ctypes.c_void_p),
                ("remote_parts", ctypes.c_uint32), ("remote_part", ctypes.c_uint32),
                ("local_parts", ctypes.c_uint32), ("local_part", ctypes.c_uint32),
                ("wait_ms", ctypes.c_uint32), ("remote_rank", ctypes.c_uint32)]


class _CEvent(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("status", ctypes.c_int), ("xfer_id", ctypes.c_uint64),
                ("user_data", ctypes.c_uint64), ("request_id", ctypes.c_char_p),
                ("block_ids", ctypes.POINTER(ctypes.c_uint64)), ("num_blocks", ctypes.c_size_t),
                ("bytes", ctypes.c_uint64), ("message", ctypes.c_char_p)]


@dataclasses.dataclass(frozen=True)
class Event:
    """One kvc_event_t, copied out of the library's borrowed storage."""
    type: EventType
    status: Status
    xfer_id: int
    user_data: int
    request_id: Optional[str]
    block_ids: Tuple[int, ...]
    bytes: int
    message: str

    @classmethod
    def _from_c(cls, ev: _CEvent) -> "Event":
        return cls(type=_enum(EventType, ev.type), status=_enum(Status, ev.status),
                   xfer_id=ev.xfer_id, user_data=ev.user_data,
                   request_id=ev.request_id.decode() if ev.request_id else None,
                   block_ids=tuple(ev.block_ids[i] for i in range(ev.num_blocks)),
                   bytes=ev.bytes,
                   message=ev.message.decode(errors="replace") if ev.message else "")

    @property
    def name(self) -> str:
        return self.type.name if isinstance(self.type, EventType) else str(self.type)


# ---------------------------------------------------------------- loading --
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None
_tried: List[str] = []


def _candidates():
    env = os.environ.get("PDKV_LIBRARY")
    if env:
        yield env, "$PDKV_LIBRARY"
        return  # an explicit choice is not second-guessed
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libkvconnector.so", "libkvconnector.so.0"):
        yield os.path.join(here, name), "package folder"
    yield "libkvconnector.so.0", "loader path"
    found = ctypes.util.find_library("kvconnector")
    if found:
        yield found, "loader path (ldconfig)"


def load_library() -> ctypes.CDLL:
    """Loads libkvconnector once; raises LibraryNotFoundError naming every
    place tried."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    _tried.clear()
    for path, where in _candidates():
        if os.sep in path and not os.path.exists(path):
            _tried.append(f"{path} ({where}): no such file")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            _tried.append(f"{path} ({where}): {e}")
            continue
        _bind(lib)
        _lib = lib
        _lib_path = _resolved(path)
        return lib
    raise LibraryNotFoundError("pdkv: libkvconnector not found; tried: " + "; ".join(_tried) +
                               ". Set PDKV_LIBRARY to the path of libkvconnector.so.")


def _resolved(path: str) -> str:
    if os.sep in path:
        return os.path.realpath(path)
    try:  # ask the loader where the soname came from
        with open("/proc/self/maps") as f:
            for line in f:
                if "libkvconnector" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return path


def library_path() -> str:
    """The file libkvconnector was loaded from (loads it if needed)."""
    load_library()
    assert _lib_path is not None
    return _lib_path


def _bind(lib: ctypes.CDLL) -> None:
    P, U64P = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)
    sigs = {
        "kvc_status_str": (ctypes.c_char_p, [ctypes.c_int]),
        "kvc_free": (None, [P]),
        "kvc_agent_create": (ctypes.c_int, [ctypes.POINTER(AgentParams), ctypes.POINTER(P)]),
        "kvc_agent_destroy": (None, [P]),
        "kvc_agent_get_port": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_uint16)]),
        "kvc_agent_get_fd": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_int)]),
        "kvc_agent_progress": (ctypes.c_int, [P]),
        "kvc_agent_register_regions": (ctypes.c_int, [P, ctypes.c_uint64,
                                                      ctypes.POINTER(RegionParams),
                                                      ctypes.c_size_t]),
        "kvc_publish": (ctypes.c_int, [P, ctypes.c_char_p, U64P, ctypes.c_size_t,
                                       ctypes.POINTER(PublishParams), ctypes.POINTER(P)]),
        "kvc_unpublish": (ctypes.c_int, [P, ctypes.c_char_p]),
        "kvc_fetch": (ctypes.c_int, [P, ctypes.POINTER(FetchParams), U64P]),
        "kvc_agent_next_event": (ctypes.c_int, [P, ctypes.POINTER(_CEvent)]),
        "kvc_agent_stat": (ctypes.c_int, [P, ctypes.c_int, U64P]),
        "kvc_token_new": (ctypes.c_int, [ctypes.c_char_p]),
        "kvc_fetch_cancel": (ctypes.c_int, [P, ctypes.c_uint64]),
        "kvc_lease_renew": (ctypes.c_int, [P, ctypes.POINTER(FetchParams)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def new_token() -> str:
    """kvc_token_new(): 32 random hex digits, no agent needed."""
    buf = ctypes.create_string_buffer(33)
    st = load_library().kvc_token_new(buf)
    if st != Status.OK:
        raise KvcError.of("kvc_token_new", st)
    return buf.value.decode()


def status_str(st: int) -> str:
    try:
        return load_library().kvc_status_str(int(st)).decode()
    except OSError:
        return str(int(st))


# -------------------------------------------------------------------- log --
_PY_LEVEL = {LogLevel.ERROR: logging.ERROR, LogLevel.WARN: logging.WARNING,
             LogLevel.INFO: logging.INFO, LogLevel.DEBUG: logging.DEBUG}


def _to_logging(_arg, level, msg) -> None:
    # Runs on whichever thread logs, possibly the library's progress thread
    # holding the agent's mutex: no kvc_ call here, and nothing may escape.
    try:
        log.log(_PY_LEVEL.get(level, logging.WARNING), "%s",
                msg.decode(errors="replace") if msg else "")
    except Exception:  # noqa: BLE001 -- a handler's failure must not reach C
        pass


_LOG_TRAMPOLINE = _LOG_CB(_to_logging)  # lives as long as the module


def _c_log_level() -> LogLevel:
    env = os.environ.get("KVC_LOG_LEVEL", "").strip().lower()
    named = {"error": LogLevel.ERROR, "warn": LogLevel.WARN, "warning": LogLevel.WARN,
             "info": LogLevel.INFO, "debug": LogLevel.DEBUG}
    if env in named:
        return named[env]
    eff = log.getEffectiveLevel()
    for lvl in (LogLevel.DEBUG, LogLevel.INFO, LogLevel.WARN):
        if eff <= _PY_LEVEL[lvl]:
            return lvl
    return LogLevel.ERROR


# ------------------------------------------------------------------ agent --
BlockIds = Iterable[int]
KvParams = Mapping[str, Any]


def _u64s(ids: BlockIds):
    ids = [int(b) for b in ids]
    return (ctypes.c_uint64 * max(1, len(ids)))(*ids), len(ids)


class Agent:
    """One kvc_agent_t.  Thread-safe: every call takes self.lock.

    secret: the cluster secret (bytes-like); the library copies it and the
    copy made here for the call is overwritten with zeros once
    kvc_agent_create returns (the caller's own buffer is the caller's to
    wipe).  Without it the library reads KVC_SECRET_FILE / KVC_SECRET."""

    def __init__(self, engine_id: str, listen_host: str = "127.0.0.1", listen_port: int = 0,
                 advertise_host: Optional[str] = None, tp_size: int = 1,
                 layout_tag: Optional[str] = None, expiry_ms: Optional[int] = None,
                 xfer_timeout_ms: Optional[int] = None,
                 connect_timeout_ms: Optional[int] = None,
                 secret: Optional[Union[bytes, bytearray, memoryview]] = None,
                 lease_ms: Optional[int] = None, pending_fetch_ms: Optional[int] = None,
                 progress_thread: bool = True, route_log: bool = True):
        lib = load_library()
        self._lib = lib
        self.lock = threading.RLock()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._h: Optional[ctypes.c_void_p] = None
        p = AgentParams()
        mask = AgentField.ENGINE_ID | AgentField.LISTEN_HOST | AgentField.LISTEN_PORT | \
            AgentField.TP_SIZE
        p.engine_id = engine_id.encode()
        p.listen_host = listen_host.encode()
        p.listen_port = _port(listen_port, "listen_port", allow_zero=True)
        p.tp_size = int(tp_size)
        if advertise_host:
            mask |= AgentField.ADVERTISE_HOST
            p.advertise_host = advertise_host.encode()
        if layout_tag:
            mask |= AgentField.LAYOUT_TAG
            p.layout_tag = layout_tag.encode()
        for flag, name, val in ((AgentField.EXPIRY, "expiry_ms", expiry_ms),
                                (AgentField.XFER_TIMEOUT, "xfer_timeout_ms", xfer_timeout_ms),
                                (AgentField.CONNECT_TIMEOUT, "connect_timeout_ms",
                                 connect_timeout_ms),
                                (AgentField.LEASE, "lease_ms", lease_ms),
                                (AgentField.PENDING_FETCH, "pending_fetch_ms",
                                 pending_fetch_ms)):
            if val is not None:
                mask |= flag
                setattr(p, name, int(val))
        if progress_thread:
            mask |= AgentField.PROGRESS_THREAD
            p.progress_thread = 1
        if route_log:
            mask |= AgentField.LOG
            p.log_cb, p.log_level = _LOG_TRAMPOLINE, _c_log_level()
        buf = None
        if secret is not None:
            n = len(secret)
            # straight from the caller's buffer: no immutable bytes copy
            buf = (ctypes.c_char * n).from_buffer_copy(secret) if n else \
                ctypes.create_string_buffer(1)
            mask |= AgentField.SECRET
            p.secret, p.secret_len = ctypes.cast(buf, ctypes.c_void_p), n
        p.field_mask = int(mask)
        h = ctypes.c_void_p()
        try:
            st = lib.kvc_agent_create(ctypes.byref(p), ctypes.byref(h))
        finally:
            if buf is not None:
                ctypes.memset(buf, 0, ctypes.sizeof(buf))
        if st != Status.OK:
            raise KvcError.of("kvc_agent_create", st,
                              f"engine {engine_id} on {listen_host}:{listen_port}")
        self._h = h
        self.engine_id = engine_id
        port = ctypes.c_uint16()
        lib.kvc_agent_get_port(h, ctypes.byref(port))
        self.port: int = port.value
        fd = ctypes.c_int()
        lib.kvc_agent_get_fd(h, ctypes.byref(fd))
        self.fd: int = fd.value

    def _check(self) -> None:
        if self._h is None:
            raise StateError("agent", Status.ERR_STATE, "agent closed")

    def register_regions(self, num_blocks: int,
                         regions: Iterable[Sequence[Optional[int]]]) -> None:
        """regions: (base_address, length_bytes[, cuda_device or None])."""
        regions = list(regions)
        arr = (RegionParams * len(regions))()
        for i, r in enumerate(regions):
            arr[i].field_mask = RegionField.BASE
            arr[i].base, arr[i].len = int(r[0]), int(r[1])
            if len(r) > 2 and r[2] is not None:
                arr[i].field_mask |= RegionField.MEM_TYPE | RegionField.CUDA_DEVICE
                arr[i].mem_type, arr[i].cuda_device = MemType.CUDA, int(r[2])
        with self.lock:
            self._check()
            st = self._lib.kvc_agent_register_regions(self._h, int(num_blocks), arr, len(regions))
        if st != Status.OK:
            raise KvcError.of("kvc_agent_register_regions", st)

    def publish(self, request_id: str, block_ids: BlockIds, user_data: Optional[int] = None,
                expiry_ms: Optional[int] = None, cuda_stream: Optional[int] = None,
                token: Optional[str] = None, lease_ms: Optional[int] = None) -> str:
        """Publishes blocks (with the caller's token when given); returns the
        kv_transfer_params text (JSON)."""
        ids, n = _u64s(block_ids)
        pp = PublishParams()
        mask = PublishField(0)
        if token is not None:
            mask |= PublishField.TOKEN
            pp.kv_token = token.encode()
        for flag, name, val in ((PublishField.LEASE, "lease_ms", lease_ms),
                                (PublishField.USER_DATA, "user_data", user_data),
                                (PublishField.EXPIRY, "expiry_ms", expiry_ms),
                                (PublishField.CUDA_STREAM, "cuda_stream", cuda_stream)):
            if val is not None:
                mask |= flag
                setattr(pp, name, int(val))
        pp.field_mask = int(mask)
        out = ctypes.c_void_p()
        with self.lock:
            self._check()
            st = self._lib.kvc_publish(self._h, request_id.encode(), ids, n, ctypes.byref(pp),
                                       ctypes.byref(out))
        if st != Status.OK:
            raise KvcError.of("kvc_publish", st, request_id)
        try:
            return ctypes.string_at(out.value).decode()
        finally:
            self._lib.kvc_free(out)

    def unpublish(self, request_id: str) -> Status:
        """Status.OK (freed now), INPROGRESS (a RELEASED event follows) or
        ERR_NOT_FOUND."""
        with self.lock:
            if self._h is None:
                return Status.ERR_NOT_FOUND
            return _enum(Status, self._lib.kvc_unpublish(self._h, request_id.encode()))

    def _fetch_params(self, params: KvParams, local_block_ids: BlockIds, user_data: int = 0,
                      cuda_stream: Optional[int] = None, remote_rank: int = 0,
                      parts: Optional[Sequence[int]] = None, wait_ms: Optional[int] = None):
        rb, nr = _u64s(params["remote_block_ids"])
        lb, nl = _u64s(local_block_ids)
        fp = FetchParams()
        mask = FetchField.REMOTE | FetchField.LOCAL_BLOCKS | FetchField.USER_DATA
        keep = [str(params[k]).encode() for k in ("remote_engine_id", "remote_request_id",
                                                  "remote_host", "remote_kv_token")]
        (fp.remote_engine_id, fp.remote_request_id, fp.remote_host, fp.remote_kv_token) = keep
        fp.remote_port = _port(params["remote_port"], "remote_port", rank=int(remote_rank))
        fp.remote_block_ids, fp.num_remote_blocks = rb, nr
        fp.local_block_ids, fp.num_local_blocks = lb, nl
        fp.user_data = int(user_data)
        if cuda_stream is not None:
            mask |= FetchField.CUDA_STREAM
            fp.cuda_stream = int(cuda_stream)
        if remote_rank:
            mask |= FetchField.REMOTE_RANK
            fp.remote_rank = int(remote_rank)
        if parts is not None and tuple(parts) != (1, 0, 1, 0):
            mask |= FetchField.SLICE
            fp.remote_parts, fp.remote_part, fp.local_parts, fp.local_part = map(int, parts)
        if wait_ms:
            mask |= FetchField.WAIT
            fp.wait_ms = int(wait_ms)
        fp.field_mask = int(mask)
        return fp, (rb, lb, keep)

    def fetch(self, params: KvParams, local_block_ids: BlockIds, user_data: int = 0,
              cuda_stream: Optional[int] = None, remote_rank: int = 0,
              parts: Optional[Sequence[int]] = None, wait_ms: Optional[int] = None) -> int:
        """Starts a fetch from kv_transfer_params (a mapping with flat
        remote_block_ids); returns xfer_id.  parts = (remote_parts,
        remote_part, local_parts, local_part) for a heterogeneous-TP slice;
        wait_ms lets the fetch reach the producer before the publication
        (held there that long at most).  A remote_port that is not an int in
        1..65535 (with remote_rank added) raises InvalidParamError: it is
        never wrapped into 16 bits."""
        fp, _keep = self._fetch_params(params, local_block_ids, user_data, cuda_stream,
                                       remote_rank, parts, wait_ms)
        xid = ctypes.c_uint64()
        with self.lock:
            self._check()
            st = self._lib.kvc_fetch(self._h, ctypes.byref(fp), ctypes.byref(xid))
        if st != Status.INPROGRESS:
            raise KvcError.of("kvc_fetch", st, str(params.get("remote_request_id")))
        return xid.value

    def cancel(self, xfer_id: int) -> Status:
        """kvc_fetch_cancel: Status.OK or ERR_NOT_FOUND."""
        with self.lock:
            if self._h is None:
                return Status.ERR_NOT_FOUND
            return _enum(Status, self._lib.kvc_fetch_cancel(self._h, int(xfer_id)))

    def lease_renew(self, params: KvParams, remote_rank: int = 0) -> None:
        fp, _keep = self._fetch_params(params, [], remote_rank=remote_rank)
        with self.lock:
            self._check()
            st = self._lib.kvc_lease_renew(self._h, ctypes.byref(fp))
        if st != Status.OK:
            raise KvcError.of("kvc_lease_renew", st, str(params.get("remote_request_id")))

    def stat(self, which: Union[Stat, str]) -> int:
        """One counter: a Stat, or its name in lower case ("fetch_done")."""
        key = Stat[which.upper()] if isinstance(which, str) else Stat(which)
        v = ctypes.c_uint64()
        with self.lock:
            self._check()
            st = self._lib.kvc_agent_stat(self._h, key, ctypes.byref(v))
        if st != Status.OK:
            raise KvcError.of("kvc_agent_stat", st, key.name)
        return v.value

    def poll(self) -> List[Event]:
        """One kvc_agent_progress() and the events it queued."""
        evs: List[Event] = []
        ev = _CEvent()
        with self.lock:
            if self._h is None:
                return evs
            self._lib.kvc_agent_progress(self._h)
            while self._lib.kvc_agent_next_event(self._h, ctypes.byref(ev)) == Status.OK:
                evs.append(Event._from_c(ev))
        return evs

    def start(self, on_event: Callable[[Event], None], idle_s: float = 0.05) -> None:
        """Starts the progress thread: on_event(Event) for every event."""
        def run():
            pl = select.poll()
            pl.register(self.fd, select.POLLIN)
            while not self._stop:
                pl.poll(int(idle_s * 1000))
                for e in self.poll():
                    on_event(e)
        self._thread = threading.Thread(target=run, name=f"pdkv-{self.engine_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self.lock:
            if self._h is not None:
                self._lib.kvc_agent_destroy(self._h)
                self._h = None

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _port(value: Any, what: str, rank: int = 0, allow_zero: bool = False) -> int:
    """A TCP port as an int in range (with rank added); InvalidParamError
    otherwise: never truncated into the C struct's 16 bits."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError("pdkv", Status.ERR_INVALID_PARAM,
                                f"{what} must be an integer, not {type(value).__name__}")
    lo = 0 if allow_zero else 1
    if not lo <= value or value + rank > 65535:
        raise InvalidParamError("pdkv", Status.ERR_INVALID_PARAM,
                                f"{what} {value}" + (f" + rank {rank}" if rank else "") +
                                " is outside 1..65535")
    return value

