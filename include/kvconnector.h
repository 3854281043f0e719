/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libkvconnector — move KV-cache blocks from a prefill engine (producer, "P")
 * to a decode engine (consumer, "D") over UCX.  See docs/ARCHITECTURE.md §3.
 *
 * Model
 * -----
 * An *agent* (kvc_agent_t) per engine worker owns a UCX context and worker, a
 * side-channel TCP listener (advertised as remote_host:remote_port in
 * kv_transfer_params) and a set of registered KV *regions*.  All regions share
 * num_blocks; block id b names block b of every region at once:
 *     block b of region r lives at base_r + b * block_len_r.
 *
 * Producer: kvc_publish() keeps a request's blocks readable and returns the
 * kv_transfer_params JSON text.  The blocks are released (KVC_EV_RELEASED)
 * when the consumer's notification "<remote_request_id>:<tp>" arrives, or
 * when they expire (KVC_EV_EXPIRED).  The engine must not reuse the blocks of
 * a published request before one of these two events.  Either event waits
 * until no push and no confirmed one-sided read of the publication uses the
 * blocks any more (see "How bytes move").
 *
 * Consumer: kvc_fetch() handshakes with the producer (once per producer
 * instance, cached), reads every remote block into the matching local block
 * (contiguous runs coalesced), then notifies the producer.  The outcome is one
 * KVC_EV_FETCH_DONE or KVC_EV_FETCH_FAILED event.  FETCH_DONE: every byte of
 * every fetched block is the producer's KV of that publication, read while
 * the producer held the blocks for this fetch.  After FETCH_FAILED, no local
 * block of that fetch holds valid data (some may have been partly written),
 * and nothing of that fetch is written into local blocks any more: the event
 * comes only after every receive and read of the fetch completed or was
 * cancelled.
 *
 * Threading contract
 * ------------------
 * Default: one thread drives an agent: every kvc_ function taking a
 * kvc_agent_t must be called from that thread (or with external locking).
 * The library starts no threads.  Nothing happens unless the driving thread
 * calls kvc_agent_progress(); in particular a producer must keep
 * progressing, since without RDMA hardware a remote read is served by the
 * producer's worker.
 * With progress_thread = 1 (KVC_AGENT_FIELD_PROGRESS_THREAD) the agent starts
 * one internal thread that progresses it by itself (no caller loop needed);
 * then every kvc_ function may be called from any thread: calls are
 * serialised on the agent's mutex.  Events are still popped with
 * kvc_agent_next_event() (pop from one thread: an event's borrowed strings
 * stay valid until the next kvc_agent_next_event/progress/destroy call; the
 * internal thread never frees them).  The fd
 * stays usable for a caller's poll (readable while events are queued);
 * kvc_agent_progress() and kvc_agent_wait() remain allowed and harmless.
 * kvc_agent_destroy() stops and joins the thread first.
 * There are no user callbacks except the log callback, which runs on the
 * thread that called the kvc_ function that logs (with a progress thread:
 * possibly that thread, holding the agent's mutex).
 *
 * Driving an agent from libevent
 * ------------------------------
 *     static void on_kvc(evutil_socket_t fd, short what, void *arg) {
 *         kvc_agent_t *a = arg;
 *         kvc_event_t ev;
 *         kvc_agent_progress(a);
 *         while (kvc_agent_next_event(a, &ev) == KVC_OK)
 *             handle(&ev);              // may call kvc_publish/kvc_fetch
 *     }
 *     int fd;
 *     kvc_agent_get_fd(a, &fd);
 *     struct event *e = event_new(base, fd, EV_READ | EV_PERSIST, on_kvc, a);
 *     event_add(e, NULL);
 *     // after kvc_publish()/kvc_fetch() from other callbacks, the fd becomes
 *     // readable by itself: no extra wakeup is needed.
 *
 * The fd is level-triggered: it stays readable while the agent has work, so
 * a loop that does not call kvc_agent_progress() spins.  Timers (expiry,
 * timeouts) are part of the fd; no separate timer event is needed.
 *
 * CUDA ordering contract
 * ----------------------
 * The connector never synchronises the engine's streams or devices, and it
 * leaves the calling thread's current device as it found it.  Its own copies
 * run on private non-blocking streams, one per device that holds a region
 * (the device is read from the pointer, cudaPointerGetAttributes), so they
 * are ordered after the engine's work only through what the engine passes:
 *  - kvc_publish: a cudaEvent_t recorded after the kernels that wrote the
 *    blocks (KVC_PUBLISH_FIELD_CUDA_EVENT), or the cudaStream_t they ran on
 *    (KVC_PUBLISH_FIELD_CUDA_STREAM, regions on one device only).  The
 *    connector's streams wait on it (cudaStreamWaitEvent).  Staged: kvc_publish
 *    returns at once, without a host sync (the device-to-pool copies of a
 *    pull are queued behind that wait); so does an agent that exports its
 *    regions over CUDA IPC (see "How bytes move"): an event is recorded
 *    after that wait, and a consumer process on this node copies only once
 *    the producer confirmed its read, which it does once that event is
 *    complete (waited for on the host there only if the writes still run).
 *    Direct: it returns once the writes are complete (a host sync of the
 *    wait, since UCX reads device memory outside any stream of ours).
 *    The engine never has to synchronise.  Without either field the caller
 * guarantees that its writes to the blocks are complete (e.g. it synchronised its stream).
 *  - kvc_fetch: a cudaStream_t that will read the blocks
 *    (KVC_FETCH_FIELD_CUDA_STREAM).  Staged regions: FETCH_DONE comes once
 *    every pool-to-device copy has completed (their events are polled, no
 *    host sync), so any later work sees the blocks.  With regions on one device the copies also
 *    wait for the work queued on that stream before the data arrived (which
 *    may still read the blocks' previous contents); with several devices the
 *    engine must not hand a fetch blocks its queued work still reads.
 *    Without the stream the connector synchronises its copies (one host sync
 *    per device per fetch) before FETCH_DONE.
 *  - Default streams.  A stream field that is set names a stream, 0
 *    included: 0 (what torch.cuda.current_stream().cuda_stream gives on the
 *    default stream) and cudaStreamLegacy are the legacy default stream of
 *    the regions' device, cudaStreamPerThread the calling thread's default
 *    stream; only an unset field means "no stream".  The work on a
 *    kvc_fetch stream that the copies wait for is taken at the kvc_fetch
 *    call, on the caller's thread.  Since the per-thread default stream can
 *    only be named by its own thread, FETCH_DONE for a fetch given
 *    cudaStreamPerThread comes after a host sync of the copies (made on the
 *    progress thread), not through a stream wait.
 * FETCH_FAILED is reported only after every copy the connector queued has
 * finished: nothing is written into local blocks after the failure event.
 * A failed CUDA call is cleared from CUDA's last error (cudaGetLastError) so
 * that it does not resurface in the engine, and is reported as
 * KVC_ERR_CUDA (or KVC_ERR_NO_MEMORY / KVC_ERR_NO_DEVICE) with the CUDA
 * error name in the message.
 *
 * How bytes move
 * --------------
 * Per producer, after the handshake: if the producer's regions are mapped on
 * this host (connector-allocated pools over shared memory), the consumer
 * reads them one-sided through UCX's mapping; otherwise the consumer sends
 * the list of runs and the producer pushes them as UCX active messages
 * (rendezvous for large ones) straight into the local blocks.  UCX's tcp
 * transport has no native get, so this is also the fast path there.
 *
 * One-sided reads are bracketed by the producer's word: before the first
 * byte the consumer asks the producer to confirm the publication (id, token,
 * blocks: the checks of a push) and to hold its blocks for this fetch; after
 * the last byte it asks whether the hold stayed intact.  A refusal at either
 * point fails the fetch with KVC_ERR_DENIED.  A hold lasts at most the
 * producer's xfer_timeout_ms; a release (notification, expiry, unpublish)
 * waits for the holds and for the pushes in flight before its event.  Each
 * bracket costs one round trip on the UCX endpoint before and one after the
 * data.
 *
 * CUDA regions are registered with UCX as device memory ("direct") when UCX
 * reports CUDA memory support (ucp_context_query, memory types); otherwise
 * they are staged: nothing of them is registered with UCX, the producer
 * pushes (device -> pinned pool slot -> wire, copies and sends pipelined)
 * and the consumer receives each chunk into a slot, then slot -> device; a
 * consumer on the producer's host copies each chunk straight from the
 * producer's slot instead (the pool mapped and pinned there: staged-shm).
 * The pool is bounded (staging_pool_bytes, 256 MiB by default), whatever
 * the size of the regions.  Per producer, the consumer
 * reads device memory one-sided only when the endpoint has a transport that
 * reaches it (cuda_ipc on one host, an RDMA transport across hosts);
 * otherwise the producer pushes.  A get forced with KVC_PROTO=get over a
 * transport without such a lane fails the fetch with KVC_ERR_UNSUPPORTED
 * instead of letting UCX emulate it with a host memcpy into device memory.
 * The choice and the transports are counted in the stats
 * (KVC_STAT_CUDA_DIRECT_REGIONS .. KVC_STAT_TRANSPORTS) and logged at debug
 * level ("peer ... transports=... path=...").
 *
 * CUDA IPC on one node (the CUDA runtime alone, no UCX CUDA transport):
 * when every region on both sides is CUDA memory, the producer exports the
 * allocation behind each region (cudaIpcGetMemHandle of its base, the
 * region's offset, the GPU's PCI bus id) and sends that table, inside the
 * authenticated and sealed handshake, to a consumer that connected from
 * its host and said it can use it.  The consumer uses it when the producer
 * is another process on its node (same boot id, IPC and PID namespaces),
 * each producer GPU is visible to it (PCI bus id), and every allocation
 * opens (cudaIpcOpenMemHandle, on the device of the local region, peer
 * access enabled lazily); the mappings are opened once per producer
 * instance and closed when the peer goes.  A fetch then copies device to
 * device (cudaMemcpyAsync per coalesced run and region) on the connector's
 * stream of each local device, bracketed by the HOLD/UNHOLD above: the
 * UNHOLD goes out once the copies' events completed, so FETCH_DONE means
 * the producer held the blocks for the whole read; a read after expiry,
 * abort or a broken hold fails with KVC_ERR_DENIED.  With
 * KVC_FETCH_FIELD_CUDA_STREAM the copies also wait for the work queued on
 * that stream (regions on one device), as staged copies do.  Only whole
 * blocks go this way (a sliced fetch is pushed), only with the automatic
 * protocol (KVC_PROTO=push or get never use it), and never between two
 * agents of one process (CUDA cannot open its own handles).  Which memory
 * takes which way:
 *  - cudaMalloc memory (PyTorch's caching allocator by default): the
 *    allocation's cudaIpcGetMemHandle handle, in the table;
 *  - memory the engine maps itself with the driver's VMM API (cuMemCreate,
 *    cuMemMap; PyTorch with expandable_segments:True maps 20 MiB physical
 *    allocations one after the other): each physical allocation behind the
 *    regions is exported as a POSIX fd (cuMemExportToShareableHandle) when
 *    it was created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR allowed
 *    (PyTorch requests it unless fabric handles work there); the fds
 *    go over a Unix socket of the producer's (abstract namespace, named in
 *    the sealed table with a token that every request must carry, peer
 *    credentials checked both ways), and the consumer maps them again in
 *    order into one reserved range (cuMemImportFromShareableHandle,
 *    cuMemAddressReserve, cuMemMap, cuMemSetAccess) before its first fetch
 *    from that producer, which waits for it (within the connect timeout);
 *  - VMM allocations without that handle type (vLLM's sleep-mode
 *    CuMemAllocator creates them with none; fabric-only ones), stream-
 *    ordered pools (cudaMallocAsync), a producer in another network
 *    namespace (its socket is out of reach), host memory: the path above.
 * Anything that prevents it (another node, memory that cannot be exported
 * as above, a GPU not visible, an open, import or map that fails) leaves
 * that producer on the path above, logged at info or warn level; nothing
 * fails for it.  Disabled
 * with KVC_AGENT_FIELD_CUDA_IPC = 0 or KVC_IPC=0 (either side).  Counted in
 * KVC_STAT_PEERS_IPC and KVC_STAT_BYTES_IPC; the debug line of a finished
 * fetch says path=ipc.
 *
 * Environment
 * -----------
 * UCX_* (UCX_TLS, UCX_NET_DEVICES, ...) as UCX documents them;
 * KVC_LOG_LEVEL=error|warn|info|debug (default log level);
 * KVC_PROTO=auto|get|push (consumer protocol, overrides the parameter);
 * KVC_PUSH_CHUNK_KB (largest pushed message, default 4096; tuning);
 * KVC_STAGING_POOL_MB (staging pool size, overrides staging_pool_bytes);
 * KVC_CUDA_STAGED=1 (stage CUDA regions through the pool even when UCX
 * could register device memory; for comparisons and troubleshooting);
 * KVC_IPC=0|1 (the same-node CUDA IPC path off or on; overrides
 * KVC_AGENT_FIELD_CUDA_IPC; default on);
 * KVC_TEST_HOST_ID (tests only: the node identity CUDA IPC compares);
 * KVC_STAGED_WIRE=1 (consumer: staged chunks cross the wire even from a
 * producer on this host, instead of being copied from its mapped pool;
 * comparisons); KVC_STAGE_WINDOW (slots one staged job holds, default 4;
 * tuning);
 * KVC_TEST_FD_BATCH (tests only: VMM allocations' fds asked for N at a
 * time instead of 253);
 * KVC_TEST_WIRE_VERSION (tests only: speak another handshake version);
 * KVC_TEST_NO_LIVE (tests only: a consumer that closes its side channel
 * after the handshake, KVC_HFLAG_LIVE left out);
 * KVC_SECRET_FILE (path of a file holding the cluster secret, trailing
 * newline stripped) or KVC_SECRET (the secret itself, for tests): read by
 * kvc_agent_create() when the parameters carry no secret.
 *
 * Security (SECURITY.md)
 * ----------------------
 * Peers authenticate each other on the side channel with a shared cluster
 * secret (HMAC-SHA-256 challenge-response, nonces from both sides) before any
 * worker address or rkey leaves the producer, and those then travel sealed
 * (AES-256-GCM, keys from the secret and both nonces); what goes through UCX
 * afterwards is not encrypted (SECURITY.md).  Without a secret the agent
 * works, logs a warning once and reports KVC_STAT_AUTHENTICATED = 0.  Each
 * publication carries a random 128-bit token (kv_transfer_params key
 * "remote_kv_token"); pulls and notifications must present it.  Memory is
 * registered for remote reads only (UCP_MEM_MAP_PROT_REMOTE_READ); what
 * that stops depends on the transport.  RDMA: the NIC enforces it, no peer
 * writes.  Shared memory (connector pools, one host): UCX maps a pool
 * read-write into the process it hands the pool's rkey to, so an
 * authenticated peer on this host that was given rkeys (automatic or GET
 * consumers) can write the pool.  tcp and other emulated RMA: UCX serves a
 * put at any address whatever the registration, so the agent enables RMA
 * only with KVC_PROTO=get or for CUDA regions registered directly; without
 * RMA (push, and automatic without direct CUDA regions) no peer writes this
 * agent's memory except through such a shared-memory mapping.  With
 * one-sided gets (shared memory, RDMA) an authenticated peer can read any
 * registered memory: the bracket above protects honest consumers from
 * stale blocks, not the producer from a hostile reader.
 *
 * Conventions: functions return kvc_status_t; out-parameters are written
 * only on success (KVC_OK, or KVC_INPROGRESS for kvc_fetch); "borrowed"
 * pointers are not freed by the library; strings returned to the caller are
 * freed with kvc_free().
 */
#ifndef KVCONNECTOR_H
#define KVCONNECTOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVC_API __attribute__((visibility("default")))
#else
#define KVC_API
#endif

/** Status codes.  Values are stable and never renumbered. */
typedef enum {
    KVC_OK = 0,
    KVC_INPROGRESS = 1, /**< started; the outcome arrives as an event */
    KVC_AGAIN = 2,      /**< nothing to report now (kvc_agent_next_event) */
    KVC_ERR_NO_MEMORY = -1,
    KVC_ERR_INVALID_PARAM = -2,
    KVC_ERR_UNREACHABLE = -3,  /**< side channel: connect/handshake failed or timed out */
    KVC_ERR_TIMED_OUT = -4,    /**< a fetch's data did not land within xfer_timeout_ms; the
                                    producer is then treated as failed (all its fetches fail,
                                    the next fetch handshakes again).  Also: a fetch registered
                                    before its publication (KVC_FETCH_FIELD_WAIT) whose
                                    publication did not come within the wait (the producer
                                    stays usable) */
    KVC_ERR_VERSION = -5,      /**< peer speaks another handshake wire version */
    KVC_ERR_INCOMPATIBLE = -6, /**< layout tag, region count or block geometry differ */
    KVC_ERR_NOT_FOUND = -7,
    KVC_ERR_EXISTS = -8,       /**< e.g. a request id already published */
    KVC_ERR_PROTOCOL = -9,     /**< malformed message from a peer */
    KVC_ERR_PEER_FAILED = -10, /**< peer died or its endpoint failed mid-transfer */
    KVC_ERR_CANCELED = -11,    /**< agent destroyed with the transfer in flight, or the
                                    fetch was cancelled (kvc_fetch_cancel) */
    KVC_ERR_TRANSPORT = -12,   /**< UCX reported an error */
    KVC_ERR_IO = -13,          /**< socket or system call failure */
    KVC_ERR_UNSUPPORTED = -14, /**< e.g. CUDA region in a build without CUDA */
    KVC_ERR_NO_DEVICE = -15,   /**< CUDA built in but no usable device */
    KVC_ERR_STATE = -16,       /**< call not valid now (e.g. regions not registered) */
    KVC_ERR_AUTH = -17,        /**< side channel: the peer failed cluster authentication
                                    (different secret, or a secret on one side only), or
                                    the sealed handshake was changed in transit */
    KVC_ERR_DENIED = -18,      /**< producer refused a pull or a one-sided read: unknown,
                                    expired or released publication, or wrong token
                                    (see kvc_publish) */
    KVC_ERR_CUDA = -19,        /**< a CUDA runtime call failed; the message (log line, event)
                                    names the CUDA error (e.g. cudaErrorIllegalAddress) */
    KVC_ERR_BUSY = -20,        /**< producer full: a fetch registered before its publication
                                    was refused, or gave way to another consumer's, at the
                                    bounds on held registrations (per source address, in
                                    total, bytes), or the handshake was refused because every
                                    consumer record of the producer is in use (a held
                                    registration or a staged push each) */
} kvc_status_t;

/** Static string naming `st` ("KVC_ERR_UNREACHABLE" style); never NULL. */
KVC_API const char *kvc_status_str(kvc_status_t st);

/** Frees memory returned by the library (JSON text). NULL is a no-op. */
KVC_API void kvc_free(void *p);

/* ------------------------------------------------------------------ log -- */

typedef enum {
    KVC_LOG_ERROR = 0,
    KVC_LOG_WARN = 1,
    KVC_LOG_INFO = 2,
    KVC_LOG_DEBUG = 3,
} kvc_log_level_t;

/** Log sink.  `msg` is one line without newline, borrowed for the call.
 * Runs on the agent's driving thread.  Must not call kvc_ functions. */
typedef void (*kvc_log_cb_t)(void *arg, kvc_log_level_t level, const char *msg);

/* ---------------------------------------------------------------- agent -- */

typedef struct kvc_agent kvc_agent_t; /* opaque */

/** How the consumer moves bytes.  AUTO: one-sided RMA get when the producer's
 * memory is directly reachable (shared-memory pool on the same host), else
 * producer push (UCX active-message rendezvous), which is what UCX's tcp
 * transport does fast (its emulated get is slow).  GET enables UCX's RMA
 * feature for the whole agent: use it only with RDMA hardware, since UCX's
 * emulated RMA (tcp, shared memory) lets any authenticated peer write this
 * agent's memory (SECURITY.md).  A GET consumer of a producer that cannot
 * serve one-sided reads (no connector pool, no RMA in its UCX context) is
 * refused at the handshake: its fetches fail at once with
 * KVC_ERR_UNSUPPORTED. */
typedef enum {
    KVC_PROTO_AUTO = 0,
    KVC_PROTO_GET = 1,
    KVC_PROTO_PUSH = 2,
} kvc_proto_t;

enum {
    KVC_AGENT_FIELD_ENGINE_ID = 1u << 0,
    KVC_AGENT_FIELD_LISTEN_HOST = 1u << 1,
    KVC_AGENT_FIELD_LISTEN_PORT = 1u << 2,
    KVC_AGENT_FIELD_ADVERTISE_HOST = 1u << 3,
    KVC_AGENT_FIELD_LOG = 1u << 4,
    KVC_AGENT_FIELD_CONNECT_TIMEOUT = 1u << 5,
    KVC_AGENT_FIELD_EXPIRY = 1u << 6,
    KVC_AGENT_FIELD_XFER_TIMEOUT = 1u << 7,
    KVC_AGENT_FIELD_LAYOUT_TAG = 1u << 8,
    KVC_AGENT_FIELD_TP_SIZE = 1u << 9,
    KVC_AGENT_FIELD_PROTO = 1u << 10,
    KVC_AGENT_FIELD_LOG_LEVEL = 1u << 11,
    KVC_AGENT_FIELD_SECRET = 1u << 12,
    KVC_AGENT_FIELD_MAX_HANDSHAKES = 1u << 13,
    KVC_AGENT_FIELD_STAGING_POOL = 1u << 14,
    KVC_AGENT_FIELD_PROGRESS_THREAD = 1u << 15,
    KVC_AGENT_FIELD_LEASE = 1u << 16,
    KVC_AGENT_FIELD_PENDING_FETCH = 1u << 17, /**< pending_fetch_ms and the three bounds */
    KVC_AGENT_FIELD_CUDA_IPC = 1u << 18,      /**< cuda_ipc */
};

/** Agent parameters.  Only fields named in field_mask are read; others take
 * the default shown.  Strings are borrowed for the call (copied). */
typedef struct {
    uint64_t field_mask;
    const char *engine_id;       /**< required; remote_engine_id of P */
    const char *listen_host;     /**< side channel bind address; "127.0.0.1" */
    uint16_t listen_port;        /**< 0 (default): pick a free port */
    const char *advertise_host;  /**< remote_host in kv_transfer_params;
                                      default listen_host */
    kvc_log_cb_t log_cb;         /**< default: stderr, level from KVC_LOG_LEVEL
                                      (error|warn|info|debug, default warn) */
    void *log_arg;               /**< borrowed: until kvc_agent_destroy */
    kvc_log_level_t log_level;   /**< most verbose level passed on; read with
                                      KVC_AGENT_FIELD_LOG (callback and level) or
                                      KVC_AGENT_FIELD_LOG_LEVEL (level for the
                                      default logger); default: KVC_LOG_LEVEL */
    uint32_t connect_timeout_ms; /**< side-channel connect + handshake; 5000 */
    uint32_t expiry_ms;          /**< published blocks expire after; 480000 */
    uint32_t xfer_timeout_ms;    /**< data phase of a fetch; 60000 */
    const char *layout_tag;      /**< must match on both sides; "NHD" */
    uint32_t tp_size;            /**< this engine's TP size; 1 */
    kvc_proto_t proto;           /**< consumer transfer protocol; AUTO.  The
                                      env KVC_PROTO=get|push|auto overrides. */
    const void *secret;          /**< cluster secret (any bytes, copied; 1..4096);
                                      default: env KVC_SECRET_FILE, else KVC_SECRET,
                                      else none (unauthenticated, warned once) */
    size_t secret_len;
    uint32_t max_handshakes;   /**< side-channel handshakes served at once (each
                                    address: a quarter of it, at least 4); 256 */
    size_t staging_pool_bytes; /**< pinned host memory through which CUDA regions
                                    are staged when UCX cannot register device
                                    memory (KVC_AGENT_FIELD_STAGING_POOL);
                                    256 MiB.  Split into slots of one pushed
                                    message (KVC_PUSH_CHUNK_KB, 4 MiB, or one
                                    block when larger); at least two slots.
                                    The env KVC_STAGING_POOL_MB overrides it. */
    int progress_thread;       /**< 1: an internal thread progresses the agent and every
                                    kvc_ call may come from any thread (see "Threading
                                    contract"); 0 (default): the caller drives it */
    uint32_t lease_ms;         /**< producer: a publication is held for this long unless a
                                    consumer renews it (kvc_lease_renew; a pull renews
                                    too); missed renewals free it (KVC_EV_EXPIRED, message
                                    "lease not renewed").  expiry_ms stays the upper
                                    bound.  0: no lease, expiry_ms only.  30000 */
    uint32_t pending_fetch_ms; /**< producer: how long a fetch that arrives before its
                                    publication (KVC_FETCH_FIELD_WAIT on the consumer) is
                                    held waiting for kvc_publish of that id (push-mode
                                    registration).  The consumer's wait_ms bounds it too.
                                    Past it the consumer gets FETCH_FAILED with
                                    KVC_ERR_TIMED_OUT.  0: never hold (refused at once,
                                    KVC_ERR_DENIED).  30000 */
    /* With KVC_AGENT_FIELD_PENDING_FETCH all four are read; 0 in a bound
     * means its default. */
    uint32_t max_pending_fetches;  /**< held registrations in total; 4096 */
    uint32_t max_pending_per_peer; /**< held registrations of all consumers that handshook
                                        from one source address (the consumer key is the
                                        consumer's own choice, its address is not); 1024 */
    size_t max_pending_bytes;      /**< memory of held registrations (their pull
                                        messages) in total; 64 MiB.  At any of the three
                                        bounds the bound is shared fairly: a registration
                                        takes the place of one of whoever holds more (the
                                        source address holding the most, then within an
                                        address the consumer holding the most), else it is
                                        refused; either way the one refused gets
                                        FETCH_FAILED with KVC_ERR_BUSY.  So a consumer
                                        always gets its share, whatever keys or
                                        connections others invent. */
    int cuda_ipc; /**< KVC_AGENT_FIELD_CUDA_IPC: 0 disables the same-node CUDA IPC
                       path on both sides (this producer exports no handles,
                       this consumer opens none); 1 (default) allows it.  The env
                       KVC_IPC=0|1 overrides.  See "How bytes move". */
} kvc_agent_params_t;

/**
 * Creates an agent: UCX context and worker (UCX honours UCX_TLS,
 * UCX_NET_DEVICES, ...), and a listening side channel.
 * KVC_OK: *out set; destroy with kvc_agent_destroy().
 * KVC_ERR_INVALID_PARAM (no engine id, bad host, empty or oversized secret,
 * unreadable KVC_SECRET_FILE), KVC_ERR_IO (bind/listen),
 * KVC_ERR_TRANSPORT (UCX init), KVC_ERR_NO_MEMORY.
 */
KVC_API kvc_status_t kvc_agent_create(const kvc_agent_params_t *params, kvc_agent_t **out);

/**
 * Destroys the agent.  Fetches in flight are cancelled (no event is
 * delivered for them any more), published blocks are dropped, connector-
 * allocated pools are freed.  NULL is a no-op.
 */
KVC_API void kvc_agent_destroy(kvc_agent_t *a);

/** The side-channel port actually bound (useful with listen_port 0). */
KVC_API kvc_status_t kvc_agent_get_port(const kvc_agent_t *a, uint16_t *port);

/** One pollable fd (readable when kvc_agent_progress() has work).  Owned by
 * the agent: do not close or read it.  KVC_OK always for a valid agent. */
KVC_API kvc_status_t kvc_agent_get_fd(const kvc_agent_t *a, int *fd);

/**
 * Does all work that is ready, never blocks: side-channel I/O, UCX progress,
 * expiry and timeouts.  Queues events for kvc_agent_next_event().
 * KVC_OK, or KVC_ERR_IO if polling failed (the agent stays usable).
 */
KVC_API kvc_status_t kvc_agent_progress(kvc_agent_t *a);

/**
 * Convenience for blocking users: waits up to timeout_ms (-1: forever) for
 * the fd, then calls kvc_agent_progress().  KVC_OK or KVC_ERR_IO.
 */
KVC_API kvc_status_t kvc_agent_wait(kvc_agent_t *a, int timeout_ms);

/* -------------------------------------------------------------- regions -- */

typedef enum {
    KVC_MEM_HOST = 0,
    KVC_MEM_CUDA = 1,
} kvc_mem_type_t;

enum {
    KVC_REGION_FIELD_BASE = 1u << 0,
    KVC_REGION_FIELD_MEM_TYPE = 1u << 1,
    KVC_REGION_FIELD_CUDA_DEVICE = 1u << 2,
};

/** One region: len bytes = num_blocks * block_len. */
typedef struct {
    uint64_t field_mask;
    size_t len;              /**< required; a non-zero multiple of num_blocks */
    void *base;              /**< borrowed: must stay valid until destroy.  Without
                                  this field the connector allocates a host pool
                                  (shared memory, fastest on one host); read its
                                  address with kvc_region_base(). */
    kvc_mem_type_t mem_type; /**< default KVC_MEM_HOST; CUDA needs base */
    int cuda_device;         /**< default 0 */
} kvc_region_params_t;

/**
 * Registers the KV regions, once per agent, before publish or fetch.
 * CUDA regions are registered with UCX directly when UCX supports CUDA
 * memory, otherwise staged through the agent's bounded pinned pool.
 * KVC_OK; KVC_ERR_INVALID_PARAM (n == 0, len not a multiple of num_blocks);
 * KVC_ERR_STATE (already registered); KVC_ERR_UNSUPPORTED (CUDA without CUDA
 * build); KVC_ERR_NO_DEVICE; KVC_ERR_TRANSPORT; KVC_ERR_NO_MEMORY.
 * On failure nothing stays registered.
 */
KVC_API kvc_status_t kvc_agent_register_regions(kvc_agent_t *a, uint64_t num_blocks,
                                                const kvc_region_params_t *regions, size_t n);

/** Host address of region `idx` (the pool, or the caller's base; for staged
 * CUDA regions the device base).  KVC_ERR_NOT_FOUND for a bad index. */
KVC_API kvc_status_t kvc_region_base(const kvc_agent_t *a, size_t idx, void **base);

/* ------------------------------------------------------------- producer -- */

enum {
    KVC_PUBLISH_FIELD_EXPIRY = 1u << 0,
    KVC_PUBLISH_FIELD_USER_DATA = 1u << 1,
    KVC_PUBLISH_FIELD_CONSUMERS = 1u << 2,
    KVC_PUBLISH_FIELD_CUDA_EVENT = 1u << 3,
    KVC_PUBLISH_FIELD_CUDA_STREAM = 1u << 4,
    KVC_PUBLISH_FIELD_TOKEN = 1u << 5,
    KVC_PUBLISH_FIELD_LEASE = 1u << 6,
    KVC_PUBLISH_FIELD_LAYERWISE = 1u << 7, /**< no value: see kvc_publish_ready() */
};

typedef struct {
    uint64_t field_mask;
    uint32_t expiry_ms; /**< default: the agent's expiry_ms */
    uint64_t user_data; /**< echoed in this request's events */
    uint32_t consumers; /**< notifications needed before the blocks are released
                             (heterogeneous TP: decode_tp / prefill_tp when decode
                             TP is larger).  Default 0: taken from the first
                             notification, "<id>:<consumer tp>", as
                             max(1, consumer_tp / this agent's tp_size).
                             Pulls served per publication: at least 8, and
                             twice this count or the fan-in each pull states
                             (the consumer's TP size), so any TP ratio works
                             without it. */
    void *cuda_event;   /**< cudaEvent_t, borrowed for the call: recorded by the
                             engine after its writes to the blocks; the copies
                             wait for it.  See "CUDA ordering contract". */
    void *cuda_stream;  /**< cudaStream_t, borrowed for the call: the stream whose
                             queued work wrote the blocks (regions on one device
                             only; else pass an event).  0 is the legacy default
                             stream: the field mask, not the value, says whether a
                             stream is given. */
    const char *kv_token; /**< KVC_PUBLISH_FIELD_TOKEN: the publication's token, 32 hex
                               digits (borrowed for the call), chosen by the caller
                               (kvc_token_new()), e.g. in vLLM's scheduler process when
                               it builds kv_transfer_params before the worker
                               publishes.  Default: a random one. */
    uint32_t lease_ms;    /**< KVC_PUBLISH_FIELD_LEASE: this publication's lease (0:
                               none); default the agent's lease_ms */
} kvc_publish_params_t;

/** Writes a fresh random token (32 lowercase hex digits and a NUL) into out,
 * for KVC_PUBLISH_FIELD_TOKEN.  Needs no agent (any process, any thread).
 * KVC_OK; KVC_ERR_INVALID_PARAM (out NULL); KVC_ERR_IO (no randomness). */
KVC_API kvc_status_t kvc_token_new(char out[33]);

/**
 * Publishes `n` blocks (copied) of request `request_id` (any printable
 * characters, ':' included; copied) and returns the kv_transfer_params JSON
 * object text in *json_out (owned by the caller, kvc_free()):
 *   {"do_remote_prefill":true,"do_remote_decode":false,
 *    "remote_block_ids":[...],"remote_engine_id":"...",
 *    "remote_request_id":"<request_id>","remote_host":"...",
 *    "remote_port":N,"tp_size":N,"remote_kv_token":"<32 hex digits>"}
 * The token is random per publication (or the caller's, KVC_PUBLISH_FIELD_TOKEN):
 * only a consumer that was handed these params can pull the blocks, renew
 * their lease or release them.  Fetches registered before this call (a
 * consumer's KVC_FETCH_FIELD_WAIT) with this id are served now, with the
 * checks of any pull (token, blocks, bounds); a held registration with
 * another token is refused (KVC_ERR_DENIED).  `params` may be NULL.  For CUDA regions the
 * connector's streams are made to wait for the engine's event or stream before this returns
 * (staged: no host sync; see "CUDA ordering contract"). KVC_OK; KVC_ERR_INVALID_PARAM
 * (empty/non-printable id, block id out of range, a CUDA stream with regions on several
 * devices, a kv_token that is not 32 hex digits; nothing is published); KVC_ERR_EXISTS (id already published); KVC_ERR_STATE (no
 * regions); KVC_ERR_NO_MEMORY; KVC_ERR_CUDA (a copy or wait failed; nothing is published, no
 * copy is left queued).
 */
KVC_API kvc_status_t kvc_publish(kvc_agent_t *a, const char *request_id, const uint64_t *block_ids,
                                 size_t n, const kvc_publish_params_t *params, char **json_out);

/**
 * Layer-wise publishing.  kvc_publish with KVC_PUBLISH_FIELD_LAYERWISE
 * publishes the blocks before they are written (its CUDA event and stream
 * fields are ignored): no region of them is readable yet, and each becomes
 * readable when the engine marks it with this call, in any order, e.g. one
 * layer at a time as the forward pass writes it.  `params` (may be NULL)
 * carries the CUDA event or stream recorded after the writes to regions
 * [first_region, +num_regions) of the request's blocks, with the ordering of
 * kvc_publish ("CUDA ordering contract"); only those two fields are read.
 * A pushed fetch (the producer sends) moves each region as it becomes ready
 * and ends, with its FETCH_DONE, once every region is ready and moved; the
 * consumer needs nothing new, and a fetch that starts before the first
 * region is ready simply waits.  Other ways of reading (one-sided reads,
 * CUDA IPC, staged pushes, notify-only fetches) are served once the last
 * region is ready, as if published then.  A publication that ends before it
 * is complete (expiry, lease, kvc_unpublish, a notification) fails the
 * fetches waiting for it: KVC_ERR_TIMED_OUT after expiry, else
 * KVC_ERR_DENIED; a producer that dies fails them as any dead producer
 * does.  Marking a region that is ready already is harmless.
 * KVC_OK; KVC_ERR_NOT_FOUND (not published, or ended); KVC_ERR_INVALID_PARAM
 * (empty or out-of-range regions); KVC_ERR_CUDA (as kvc_publish; the regions
 * stay unready).
 */
KVC_API kvc_status_t kvc_publish_ready(kvc_agent_t *a, const char *request_id, size_t first_region,
                                       size_t num_regions, const kvc_publish_params_t *params);

/** Releases a published request early (e.g. the engine aborted it).
 * KVC_OK: released now, no event.  KVC_INPROGRESS: pushes or confirmed
 * one-sided reads still use the blocks; they are withdrawn from consumers at
 * once and handed back with a KVC_EV_RELEASED event (status KVC_ERR_CANCELED)
 * when the last of those ends (a read at most the agent's xfer_timeout_ms).
 * KVC_ERR_NOT_FOUND: not published (or already released). */
KVC_API kvc_status_t kvc_unpublish(kvc_agent_t *a, const char *request_id);

/* ------------------------------------------------------------- consumer -- */

enum {
    KVC_FETCH_FIELD_JSON = 1u << 0,   /**< kv_transfer_params as JSON text */
    KVC_FETCH_FIELD_REMOTE = 1u << 1, /**< the remote_* fields below */
    KVC_FETCH_FIELD_LOCAL_BLOCKS = 1u << 2,
    KVC_FETCH_FIELD_USER_DATA = 1u << 3,
    KVC_FETCH_FIELD_CUDA_STREAM = 1u << 4,
    KVC_FETCH_FIELD_SLICE = 1u << 5,       /**< remote_parts .. local_part */
    KVC_FETCH_FIELD_WAIT = 1u << 6,        /**< wait_ms: register before publication */
    KVC_FETCH_FIELD_REMOTE_RANK = 1u << 7, /**< remote_rank: which prefill TP rank */
};

typedef struct {
    uint64_t field_mask;
    /** The producer's kv_transfer_params object as text (what kvc_publish
     * returned, possibly forwarded through a proxy; unknown keys ignored). */
    const char *kv_transfer_params_json;
    /* Or the same as fields (KVC_FETCH_FIELD_REMOTE); all borrowed for the call. */
    const char *remote_engine_id;
    const char *remote_request_id;
    const char *remote_host;
    uint16_t remote_port;
    const uint64_t *remote_block_ids;
    size_t num_remote_blocks;
    /** Local block ids (copied).  Fewer than remote: the LAST remote blocks
     * are fetched.  Zero: notify only.  More than remote: invalid. */
    const uint64_t *local_block_ids;
    size_t num_local_blocks;
    uint64_t user_data; /**< echoed in the fetch's event */
    /** With KVC_FETCH_FIELD_REMOTE: remote_kv_token (32 hex digits), borrowed. */
    const char *remote_kv_token;
    /** cudaStream_t (KVC_FETCH_FIELD_CUDA_STREAM), borrowed until the fetch's event:
     * the engine's stream that reads the fetched blocks; made to wait for the
     * staging copies instead of a host sync.  0 is the legacy default stream
     * (the field mask says whether a stream is given).  See "CUDA ordering
     * contract". */
    void *cuda_stream;
    /** KVC_FETCH_FIELD_SLICE (heterogeneous TP, non-MLA, HND layout): read part
     * remote_part of remote_parts equal parts of every remote block (per
     * region) into part local_part of local_parts of the local block.  The
     * part sizes must match per region: remote_block_len / remote_parts ==
     * local_block_len / local_parts, else the fetch fails with
     * KVC_ERR_INCOMPATIBLE.  Bytes of the local block outside its part are
     * never written.  TP 1->2: decode rank r reads part r of 2 from prefill
     * rank 0 into part 0 of 1.  TP 2->1: decode reads from prefill rank 0 and
     * 1 (two fetches, remote_rank 0 and 1) part 0 of 1 into local parts 0 and
     * 1 of 2.  MLA: do not slice (its KV is replicated across ranks).  The
     * parts are heads only with an HND layout; the connector does not read
     * the layout tag, the engine slices only when its layout is HND (as vLLM's
     * NIXL does not split heads with NHD).  Different tokens per block (vLLM
     * remaps block ids when P's block size < D's) are not supported: their
     * lengths fail the part-size check.  With local_parts > 1 every block
     * travels alone (its part is not contiguous with the next block's).
     * Defaults 1, 0, 1, 0 (whole blocks). */
    uint32_t remote_parts, remote_part, local_parts, local_part;
    /** KVC_FETCH_FIELD_WAIT: if the publication does not exist yet when the
     * pull reaches the producer, the producer holds this fetch (push-mode
     * registration) up to min(wait_ms, its pending_fetch_ms) and serves it
     * the moment kvc_publish with that id and token happens.  Without the
     * field (or 0) an unknown publication is refused at once
     * (KVC_ERR_DENIED), as before: invented or stale ids fail fast.
     * With this field an empty remote_block_ids (none: decode cannot know
     * the ids prefill will choose) asks for the publication's LAST
     * num_local_blocks blocks, in its order, resolved by the producer when
     * it serves the fetch; more than it holds is refused (KVC_ERR_DENIED).
     * A notify-only fetch (no local blocks) is held the same way: its
     * notification, which releases the consumer's share of the publication,
     * goes out once the producer says the publication exists (one extra
     * round trip), so a bare release sent before prefill published is not
     * lost.  When the wait ends unmet the fetch fails with
     * KVC_ERR_TIMED_OUT; for a publication that already ended the
     * notification goes out at once (a late one: KVC_EV_UNKNOWN_NOTIFY). */
    uint32_t wait_ms;
    /** KVC_FETCH_FIELD_REMOTE_RANK: the prefill TP rank to read from.  One
     * kv_transfer_params object serves every prefill rank: rank r's side
     * channel is remote_port + r (each prefill worker's agent listens on
     * base port + its TP rank), and all ranks share the request's one token
     * (the caller supplies it to every rank's kvc_publish).  A DP rank does
     * not enter: every DP engine advertises its own remote_port, and those
     * must be at least tp_size apart (as older vLLM spaced NIXL's side
     * channels: VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank * tp_size).  vLLM's
     * current NIXL serves every rank's metadata from one scheduler port per
     * DP engine (rank in the request); libkvconnector has one listener per
     * worker agent, hence the offset.  Default 0. */
    uint32_t remote_rank;
} kvc_fetch_params_t;

/**
 * Starts a fetch.  KVC_INPROGRESS: *xfer_id set; exactly one FETCH_DONE or
 * FETCH_FAILED event with that id follows (unless the agent is destroyed
 * first).  The local regions must not be touched by the engine until then.
 * KVC_ERR_INVALID_PARAM: missing keys (remote_kv_token included), local
 * block id out of range or repeated, more local than remote blocks (nothing
 * touched, no event); KVC_ERR_INCOMPATIBLE (remote_block_ids lists more
 * than one KV-cache group, as hybrid models send: not supported yet; a list
 * holding one group is accepted); KVC_ERR_STATE (no regions); KVC_ERR_NO_MEMORY.  Remote block ids
 * out of the producer's range fail the fetch (event, KVC_ERR_INVALID_PARAM) before any data moves.
 * Failure statuses of the event include KVC_ERR_AUTH, KVC_ERR_VERSION
 * (handshake), KVC_ERR_DENIED (the producer does not know this publication
 * or token, on every path, one-sided reads included, or released it before
 * a one-sided read ended), KVC_ERR_UNSUPPORTED (GET forced against a
 * producer that cannot serve it, or device memory without a lane that
 * reaches it), KVC_ERR_PROTOCOL (data outside the requested blocks, a block
 * sent twice, a short transfer: the fetch fails, blocks not asked for are
 * never written).  The failure event comes only after every receive and
 * read of the fetch completed or was cancelled (those still running 2 s
 * after the failure are cancelled by closing the endpoint to that producer,
 * which fails its other fetches too), KVC_ERR_INCOMPATIBLE (slice sizes do
 * not match, see KVC_FETCH_FIELD_SLICE), KVC_ERR_TIMED_OUT (a registration,
 * KVC_FETCH_FIELD_WAIT, that never met its publication), KVC_ERR_BUSY (the
 * producer is full, see KVC_ERR_BUSY), KVC_ERR_PEER_FAILED (also: the
 * producer no longer knows this consumer, whose record there gave way to
 * newer ones; the next fetch handshakes again), KVC_ERR_UNSUPPORTED (also:
 * a registration or a staged push asked of a producer by a consumer that
 * gave it no endpoint of its own, which no agent of this version does),
 * KVC_ERR_CANCELED (kvc_fetch_cancel).  A fetch in flight renews the publication's lease.
 */
KVC_API kvc_status_t kvc_fetch(kvc_agent_t *a, const kvc_fetch_params_t *params, uint64_t *xfer_id);

/**
 * Cancels a fetch.  KVC_OK: from the return on, no byte of that fetch is
 * written into local blocks any more (its outstanding UCX requests were
 * cancelled and progressed to their end; as a last resort, after 2 s, the
 * endpoint to the producer was closed, which fails that producer's other
 * fetches too), and the fetch gets exactly one event, FETCH_FAILED with
 * KVC_ERR_CANCELED (queued by this call).  Blocks partly written hold no
 * valid data.  A registration the producer holds for it stays there until
 * served or expired; what it then sends is dropped on arrival.
 * KVC_ERR_NOT_FOUND: unknown id, or its event was already queued.
 * KVC_ERR_TIMED_OUT: UCX requests of the fetch did not end within 4 s even
 * with the endpoint closed (cannot happen while the producer process
 * progresses); the fetch is cancelled but bytes may still land until its
 * FETCH_FAILED/KVC_ERR_CANCELED event, which then comes when they end.
 * Blocks the caller while the requests end: normally one round trip to
 * the producer, at most 4 s.
 */
KVC_API kvc_status_t kvc_fetch_cancel(kvc_agent_t *a, uint64_t xfer_id);

/**
 * Renews the lease of a publication this consumer has not fetched yet
 * (e.g. its request waits in decode's queue).  `params` names it exactly as
 * for kvc_fetch (JSON or fields, token required, KVC_FETCH_FIELD_REMOTE_RANK
 * honoured; local blocks ignored).  The renewal travels as a RENEW pull
 * (flag on the existing PULL message, no runs) over the producer's UCX
 * endpoint, after the cached handshake; the producer checks id and token as
 * for a pull and extends the lease by its lease_ms (never past expiry).
 * Fire and forget: KVC_OK means queued; a wrong token is logged and counted
 * on the producer (KVC_STAT_DENIED), a publication that does not exist (yet,
 * or any more) is ignored (debug log); no event either way.  KVC_ERR_INVALID_PARAM (as
 * kvc_fetch), KVC_ERR_STATE (no regions), KVC_ERR_NO_MEMORY.
 */
KVC_API kvc_status_t kvc_lease_renew(kvc_agent_t *a, const kvc_fetch_params_t *params);

/* --------------------------------------------------------------- events -- */

typedef enum {
    KVC_EV_FETCH_DONE = 1,     /**< consumer: all blocks landed, producer notified */
    KVC_EV_FETCH_FAILED = 2,   /**< consumer: status says why; message has details */
    KVC_EV_RELEASED = 3,       /**< producer: consumers notified (or kvc_unpublish
                                    answered KVC_INPROGRESS: status KVC_ERR_CANCELED);
                                    no push or read uses the blocks: they are free */
    KVC_EV_EXPIRED = 4,        /**< producer: not claimed in time; no push or read
                                    uses the blocks: they are free */
    KVC_EV_UNKNOWN_NOTIFY = 5, /**< producer: a late notification, with its token,
                                    for a publication that was already released or
                                    expired (one event each, among the last 1024
                                    that ended); other notifications for unknown
                                    ids are refused (KVC_STAT_DENIED), no event */
} kvc_event_type_t;

typedef struct {
    kvc_event_type_t type;
    kvc_status_t status;       /**< KVC_OK or the failure */
    uint64_t xfer_id;          /**< fetch events */
    uint64_t user_data;        /**< from kvc_fetch / kvc_publish params */
    const char *request_id;    /**< remote_request_id (fetch) or published id;
                                    borrowed: valid until the next call of
                                    kvc_agent_next_event/progress/destroy */
    const uint64_t *block_ids; /**< producer events: the published blocks;
                                    consumer: local blocks. Borrowed as above */
    size_t num_blocks;
    uint64_t bytes;      /**< FETCH_DONE: bytes moved */
    const char *message; /**< human-readable detail, borrowed as above */
} kvc_event_t;

/** Pops the next event.  KVC_OK: *ev filled; KVC_AGAIN: none queued. */
KVC_API kvc_status_t kvc_agent_next_event(kvc_agent_t *a, kvc_event_t *ev);

/* ---------------------------------------------------------------- stats -- */

typedef enum {
    KVC_STAT_PUBLISHED = 0,
    KVC_STAT_RELEASED = 1,
    KVC_STAT_EXPIRED = 2,
    KVC_STAT_UNKNOWN_NOTIFY = 3, /**< notifications for ids not published now */
    KVC_STAT_FETCH_DONE = 4,
    KVC_STAT_FETCH_FAILED = 5,
    KVC_STAT_BYTES_FETCHED = 6,
    KVC_STAT_HANDSHAKES = 7,           /**< handshakes done by this consumer */
    KVC_STAT_PUBLISHED_NOW = 8,        /**< requests currently published */
    KVC_STAT_AUTHENTICATED = 9,        /**< 1 if a cluster secret is configured, else 0 */
    KVC_STAT_AUTH_FAILED = 10,         /**< side-channel peers refused (authentication) */
    KVC_STAT_DENIED = 11,              /**< pulls/notifications with an unknown publication
                                            or a wrong token (producer), refused */
    KVC_STAT_PEER_ERRORS = 12,         /**< malformed, oversized or too slow side-channel
                                            peers closed, handshakes over limits refused */
    KVC_STAT_CUDA_DIRECT_REGIONS = 13, /**< CUDA regions registered with UCX as device memory */
    KVC_STAT_CUDA_STAGED_REGIONS = 14, /**< CUDA regions staged through the pinned pool */
    KVC_STAT_PEERS_GET = 15,           /**< producers this consumer reads one-sided (get) */
    KVC_STAT_PEERS_PUSH = 16,          /**< producers that push to this consumer */
    KVC_STAT_TRANSPORTS = 17,          /**< KVC_TRANSPORT_* bits of the UCX transports seen on
                                            endpoints to producers (collected when the agent has
                                            CUDA regions or logs at debug level) */
    KVC_STAT_CUDA_COPIES = 18,         /**< staging copies issued (one cudaMemcpyAsync per
                                            pushed message, through a pool slot) */
    KVC_STAT_CUDA_SYNCS = 19,          /**< host synchronisations of staging streams */
    KVC_STAT_PENDING_FETCHES = 20,     /**< producer: registrations held now (fetches that
                                            arrived before their publication) */
    KVC_STAT_PENDING_SERVED = 21,      /**< producer: registrations served by kvc_publish */
    KVC_STAT_PENDING_EXPIRED = 22,     /**< producer: registrations that never met their
                                            publication (timed out) */
    KVC_STAT_PENDING_REFUSED = 23,     /**< producer: registrations refused over the bounds */
    KVC_STAT_LEASE_RENEWALS = 24,      /**< producer: lease renewals accepted */
    KVC_STAT_LEASE_EXPIRED = 25,       /**< producer: publications freed for a missed lease
                                            (also counted in KVC_STAT_EXPIRED) */
    KVC_STAT_FETCH_CANCELED = 26,      /**< consumer: fetches cancelled (kvc_fetch_cancel) */
    KVC_STAT_CONSUMERS_LOST = 27,      /**< producer: consumers whose endpoint failed (closed
                                            or died); their held and staged pulls dropped */
    KVC_STAT_PEERS_IPC = 28,           /**< producers this consumer reads over CUDA IPC
                                            (device-to-device copies on this node; not
                                            counted in KVC_STAT_PEERS_GET) */
    KVC_STAT_BYTES_IPC = 29,           /**< bytes of completed fetches copied over CUDA IPC
                                            (also in KVC_STAT_BYTES_FETCHED) */
    KVC_STAT_FETCH_STAGED_SHM = 30,    /**< consumer: staged fetches done by copying from the
                                            producer's pool mapped here (one host) */
    KVC_STAT_FETCH_STAGED_WIRE = 31,   /**< consumer: staged fetches done over the wire */
    KVC_STAT_LAST = KVC_STAT_FETCH_STAGED_WIRE
} kvc_stat_t;

/** Bits of KVC_STAT_TRANSPORTS.  Values are stable. */
enum {
    KVC_TRANSPORT_TCP = 1u << 0,
    KVC_TRANSPORT_SHM = 1u << 1,       /**< posix, sysv, xpmem, cma, knem */
    KVC_TRANSPORT_CUDA_IPC = 1u << 2,  /**< GPU to GPU on one host */
    KVC_TRANSPORT_RDMA = 1u << 3,      /**< rc, dc, ud (verbs, mlx5) */
    KVC_TRANSPORT_CUDA_COPY = 1u << 4, /**< host-device copies inside UCX */
    KVC_TRANSPORT_GDR_COPY = 1u << 5,
    KVC_TRANSPORT_OTHER = 1u << 6,
};

/** Reads one counter.  KVC_OK or KVC_ERR_INVALID_PARAM (unknown stat). */
KVC_API kvc_status_t kvc_agent_stat(const kvc_agent_t *a, kvc_stat_t which, uint64_t *value);

#ifdef __cplusplus
}
#endif
#endif /* KVCONNECTOR_H */
