# SPDX-License-Identifier: Apache-2.0
"""ctypes binding of libkvconnector (include/kvconnector.h).

The library is found, in this order, at:
  1. $PDKV_LIBRARY (a path to libkvconnector.so),
  2. this package's folder (a wheel that ships the .so beside it),
  3. the dynamic loader's path (ldconfig, LD_LIBRARY_PATH): libkvconnector.so.0.
library_path() names the file loaded; a failure names every place tried.

Agent wraps one kvc_agent_t.  The C library is single-threaded per agent;
Agent serialises every call with one lock and, once start() is called, runs a
progress thread that waits on the agent's fd, calls kvc_agent_progress() and
hands each event to a callback, so loads and notifications advance while the
engine runs its forward pass.  ctypes releases the GIL during C calls.
"""
import ctypes
import ctypes.util
import os
import select
import threading

__all__ = ["Agent", "KvcError", "load_library", "library_path", "Event", "new_token"]

KVC_OK, KVC_INPROGRESS, KVC_AGAIN = 0, 1, 2
ERR_NOT_FOUND = -7
ERR_DENIED = -18

EV_FETCH_DONE, EV_FETCH_FAILED, EV_RELEASED, EV_EXPIRED, EV_UNKNOWN_NOTIFY = 1, 2, 3, 4, 5
EVENT_NAMES = {1: "FETCH_DONE", 2: "FETCH_FAILED", 3: "RELEASED", 4: "EXPIRED",
               5: "UNKNOWN_NOTIFY"}

# agent fields
A_ENGINE_ID, A_LISTEN_HOST, A_LISTEN_PORT, A_ADVERTISE_HOST = 1, 2, 4, 8
A_LOG, A_CONNECT_TIMEOUT, A_EXPIRY, A_XFER_TIMEOUT = 16, 32, 64, 128
A_LAYOUT_TAG, A_TP_SIZE, A_PROTO, A_LOG_LEVEL = 256, 512, 1024, 2048
A_SECRET, A_MAX_HANDSHAKES, A_STAGING_POOL = 4096, 8192, 16384
A_PROGRESS_THREAD, A_LEASE, A_PENDING_FETCH = 1 << 15, 1 << 16, 1 << 17
# region fields
R_BASE, R_MEM_TYPE, R_CUDA_DEVICE = 1, 2, 4
MEM_HOST, MEM_CUDA = 0, 1
# publish fields
P_EXPIRY, P_USER_DATA, P_CONSUMERS, P_CUDA_EVENT, P_CUDA_STREAM = 1, 2, 4, 8, 16
P_TOKEN, P_LEASE = 32, 64
# fetch fields
F_JSON, F_REMOTE, F_LOCAL_BLOCKS, F_USER_DATA, F_CUDA_STREAM = 1, 2, 4, 8, 16
F_SLICE, F_WAIT, F_REMOTE_RANK = 32, 64, 128

STATS = {"published": 0, "released": 1, "expired": 2, "unknown_notify": 3,
         "fetch_done": 4, "fetch_failed": 5, "bytes_fetched": 6, "handshakes": 7,
         "published_now": 8, "authenticated": 9, "auth_failed": 10, "denied": 11,
         "peer_errors": 12, "cuda_direct_regions": 13, "cuda_staged_regions": 14,
         "pending_fetches": 20, "pending_served": 21,
         "pending_expired": 22, "pending_refused": 23, "lease_renewals": 24,
         "lease_expired": 25, "fetch_canceled": 26, "fetch_staged_shm": 28,
         "fetch_staged_wire": 29}

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


class Event:
    """One kvc_event_t, copied out of the library's borrowed storage."""
    __slots__ = ("type", "status", "xfer_id", "user_data", "request_id", "block_ids",
                 "bytes", "message")

    def __init__(self, ev):
        self.type = ev.type
        self.status = ev.status
        self.xfer_id = ev.xfer_id
        self.user_data = ev.user_data
        self.request_id = ev.request_id.decode() if ev.request_id else None
        self.block_ids = [ev.block_ids[i] for i in range(ev.num_blocks)]
        self.bytes = ev.bytes
        self.message = ev.message.decode(errors="replace") if ev.message else ""

    @property
    def name(self):
        return EVENT_NAMES.get(self.type, str(self.type))

    def __repr__(self):
        return (f"Event({self.name}, status={status_str(self.status)}, "
                f"request_id={self.request_id!r}, xfer_id={self.xfer_id})")


class KvcError(RuntimeError):
    """A kvc_ call failed; .status is the kvc_status_t, .call the function."""

    def __init__(self, call, status, detail=""):
        self.call, self.status = call, status
        super().__init__(f"{call}: {status_str(status)}" + (f" ({detail})" if detail else ""))


_lib = None
_lib_path = None
_tried = []


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


def load_library():
    """Loads libkvconnector once; raises OSError naming every place tried."""
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
    raise OSError("pdkv: libkvconnector not found; tried: " + "; ".join(_tried) +
                  ". Set PDKV_LIBRARY to the path of libkvconnector.so.")


def _resolved(path):
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


def library_path():
    """The file libkvconnector was loaded from (loads it if needed)."""
    load_library()
    return _lib_path


def _bind(lib):
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


def new_token():
    """kvc_token_new(): 32 random hex digits, no agent needed."""
    buf = ctypes.create_string_buffer(33)
    st = load_library().kvc_token_new(buf)
    if st != KVC_OK:
        raise KvcError("kvc_token_new", st)
    return buf.value.decode()


def status_str(st):
    try:
        return load_library().kvc_status_str(st).decode()
    except OSError:
        return str(st)


def _u64s(ids):
    ids = [int(b) for b in ids]
    return (ctypes.c_uint64 * max(1, len(ids)))(*ids), len(ids)


class Agent:
    """One kvc_agent_t.  Thread-safe: every call takes self.lock."""

    def __init__(self, engine_id, listen_host="127.0.0.1", listen_port=0, advertise_host=None,
                 tp_size=1, layout_tag=None, expiry_ms=None, xfer_timeout_ms=None,
                 connect_timeout_ms=None, secret=None, lease_ms=None, pending_fetch_ms=None,
                 progress_thread=True):
        lib = load_library()
        self._lib = lib
        self.lock = threading.RLock()
        self._thread = None
        self._stop = False
        p = AgentParams()
        p.field_mask = A_ENGINE_ID | A_LISTEN_HOST | A_LISTEN_PORT | A_TP_SIZE
        p.engine_id = engine_id.encode()
        p.listen_host = listen_host.encode()
        p.listen_port = int(listen_port)
        p.tp_size = int(tp_size)
        if advertise_host:
            p.field_mask |= A_ADVERTISE_HOST
            p.advertise_host = advertise_host.encode()
        if layout_tag:
            p.field_mask |= A_LAYOUT_TAG
            p.layout_tag = layout_tag.encode()
        for mask, name, val in ((A_EXPIRY, "expiry_ms", expiry_ms),
                                (A_XFER_TIMEOUT, "xfer_timeout_ms", xfer_timeout_ms),
                                (A_CONNECT_TIMEOUT, "connect_timeout_ms", connect_timeout_ms),
                                (A_LEASE, "lease_ms", lease_ms)):
            if val is not None:
                p.field_mask |= mask
                setattr(p, name, int(val))
        if pending_fetch_ms is not None:
            p.field_mask |= A_PENDING_FETCH
            p.pending_fetch_ms = int(pending_fetch_ms)
        if progress_thread:
            p.field_mask |= A_PROGRESS_THREAD
            p.progress_thread = 1
        if secret is not None:
            buf = ctypes.create_string_buffer(secret, len(secret))
            p.field_mask |= A_SECRET
            p.secret, p.secret_len = ctypes.cast(buf, ctypes.c_void_p), len(secret)
        h = ctypes.c_void_p()
        st = lib.kvc_agent_create(ctypes.byref(p), ctypes.byref(h))
        if st != KVC_OK:
            raise KvcError("kvc_agent_create", st, f"engine {engine_id} on {listen_host}:{listen_port}")
        self._h = h
        self.engine_id = engine_id
        port = ctypes.c_uint16()
        lib.kvc_agent_get_port(h, ctypes.byref(port))
        self.port = port.value
        fd = ctypes.c_int()
        lib.kvc_agent_get_fd(h, ctypes.byref(fd))
        self.fd = fd.value

    def _check(self):
        if self._h is None:
            raise KvcError("agent", -16, "agent closed")

    def register_regions(self, num_blocks, regions):
        """regions: iterable of (base_address, length_bytes[, cuda_device])."""
        regions = list(regions)
        arr = (RegionParams * len(regions))()
        for i, r in enumerate(regions):
            arr[i].field_mask = R_BASE
            arr[i].base, arr[i].len = int(r[0]), int(r[1])
            if len(r) > 2 and r[2] is not None:
                arr[i].field_mask |= R_MEM_TYPE | R_CUDA_DEVICE
                arr[i].mem_type, arr[i].cuda_device = MEM_CUDA, int(r[2])
        with self.lock:
            self._check()
            st = self._lib.kvc_agent_register_regions(self._h, int(num_blocks), arr, len(regions))
        if st != KVC_OK:
            raise KvcError("kvc_agent_register_regions", st)

    def publish(self, request_id, block_ids, user_data=None, expiry_ms=None, cuda_stream=None,
                token=None, lease_ms=None):
        """Publishes blocks (with the caller's token when given); returns the
        kv_transfer_params text (JSON)."""
        ids, n = _u64s(block_ids)
        pp = PublishParams()
        if token is not None:
            pp.field_mask |= P_TOKEN
            pp.kv_token = token.encode()
        if lease_ms is not None:
            pp.field_mask |= P_LEASE
            pp.lease_ms = int(lease_ms)
        if user_data is not None:
            pp.field_mask |= P_USER_DATA
            pp.user_data = int(user_data)
        if expiry_ms is not None:
            pp.field_mask |= P_EXPIRY
            pp.expiry_ms = int(expiry_ms)
        if cuda_stream is not None:
            pp.field_mask |= P_CUDA_STREAM
            pp.cuda_stream = int(cuda_stream)
        out = ctypes.c_void_p()
        with self.lock:
            self._check()
            st = self._lib.kvc_publish(self._h, request_id.encode(), ids, n, ctypes.byref(pp),
                                       ctypes.byref(out))
        if st != KVC_OK:
            raise KvcError("kvc_publish", st, request_id)
        try:
            return ctypes.string_at(out.value).decode()
        finally:
            self._lib.kvc_free(out)

    def unpublish(self, request_id):
        """KVC_OK (freed now), KVC_INPROGRESS (RELEASED event follows) or
        ERR_NOT_FOUND, as a status."""
        with self.lock:
            if self._h is None:
                return ERR_NOT_FOUND
            return self._lib.kvc_unpublish(self._h, request_id.encode())

    def _fetch_params(self, params, local_block_ids, user_data=0, cuda_stream=None,
                      remote_rank=0, parts=None, wait_ms=None):
        rb, nr = _u64s(params["remote_block_ids"])
        lb, nl = _u64s(local_block_ids)
        fp = FetchParams()
        fp.field_mask = F_REMOTE | F_LOCAL_BLOCKS | F_USER_DATA
        keep = [str(params[k]).encode() for k in ("remote_engine_id", "remote_request_id",
                                                  "remote_host", "remote_kv_token")]
        (fp.remote_engine_id, fp.remote_request_id, fp.remote_host, fp.remote_kv_token) = keep
        fp.remote_port = int(params["remote_port"])
        fp.remote_block_ids, fp.num_remote_blocks = rb, nr
        fp.local_block_ids, fp.num_local_blocks = lb, nl
        fp.user_data = int(user_data)
        if cuda_stream is not None:
            fp.field_mask |= F_CUDA_STREAM
            fp.cuda_stream = int(cuda_stream)
        if remote_rank:
            fp.field_mask |= F_REMOTE_RANK
            fp.remote_rank = int(remote_rank)
        if parts is not None and tuple(parts) != (1, 0, 1, 0):
            fp.field_mask |= F_SLICE
            fp.remote_parts, fp.remote_part, fp.local_parts, fp.local_part = map(int, parts)
        if wait_ms:
            fp.field_mask |= F_WAIT
            fp.wait_ms = int(wait_ms)
        return fp, (rb, lb, keep)

    def fetch(self, params, local_block_ids, user_data=0, cuda_stream=None, remote_rank=0,
              parts=None, wait_ms=None):
        """Starts a fetch from kv_transfer_params (a dict); returns xfer_id.
        parts = (remote_parts, remote_part, local_parts, local_part) for a
        heterogeneous-TP slice; wait_ms lets the fetch reach the producer
        before the publication (held there that long at most)."""
        fp, _keep = self._fetch_params(params, local_block_ids, user_data, cuda_stream,
                                       remote_rank, parts, wait_ms)
        xid = ctypes.c_uint64()
        with self.lock:
            self._check()
            st = self._lib.kvc_fetch(self._h, ctypes.byref(fp), ctypes.byref(xid))
        if st != KVC_INPROGRESS:
            raise KvcError("kvc_fetch", st, str(params.get("remote_request_id")))
        return xid.value

    def cancel(self, xfer_id):
        """kvc_fetch_cancel: status KVC_OK or ERR_NOT_FOUND."""
        with self.lock:
            if self._h is None:
                return ERR_NOT_FOUND
            return self._lib.kvc_fetch_cancel(self._h, int(xfer_id))

    def lease_renew(self, params, remote_rank=0):
        fp, _keep = self._fetch_params(params, [], remote_rank=remote_rank)
        with self.lock:
            self._check()
            st = self._lib.kvc_lease_renew(self._h, ctypes.byref(fp))
        if st != KVC_OK:
            raise KvcError("kvc_lease_renew", st, str(params.get("remote_request_id")))

    def stat(self, name):
        v = ctypes.c_uint64()
        with self.lock:
            self._check()
            st = self._lib.kvc_agent_stat(self._h, STATS[name], ctypes.byref(v))
        if st != KVC_OK:
            raise KvcError("kvc_agent_stat", st, name)
        return v.value

    def poll(self):
        """One kvc_agent_progress() and the events it queued."""
        evs = []
        ev = _CEvent()
        with self.lock:
            if self._h is None:
                return evs
            self._lib.kvc_agent_progress(self._h)
            while self._lib.kvc_agent_next_event(self._h, ctypes.byref(ev)) == KVC_OK:
                evs.append(Event(ev))
        return evs

    def start(self, on_event, idle_s=0.05):
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

    def close(self):
        self._stop = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self.lock:
            if self._h is not None:
                self._lib.kvc_agent_destroy(self._h)
                self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
