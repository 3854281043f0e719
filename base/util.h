/* SPDX-License-Identifier: Apache-2.0 */
/* Small shared helpers: checked allocation, growable byte buffers, ids. */
#ifndef PX_UTIL_H
#define PX_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Allocation that never returns NULL: on exhaustion it logs and aborts the
 * process, because every caller would otherwise have to unwind a half-built
 * request with no memory to report the error in. */
void *px_xmalloc(size_t n);
void *px_xcalloc(size_t n, size_t size);
void *px_xrealloc(void *p, size_t n);
char *px_xstrdup(const char *s);
char *px_xstrndup(const char *s, size_t n);
/* Copies at most n bytes of s (fewer at a NUL) into out[0..cap), truncated
 * to fit and always terminated (cap > 0): snprintf(out, cap, "%.*s", n, s)
 * without the format parser, for the request path. Returns bytes copied. */
size_t px_strncpyz(char *out, size_t cap, const char *s, size_t n);

/* Freed blocks of one size kept for reuse, at most PX_SPARES of them: for an
 * object made and freed on every request that is too large for malloc's
 * per-thread cache of small blocks (a block past it goes through the arena's
 * bins both ways). Not thread-safe: one owner thread. */
#define PX_SPARES 8
typedef struct px_spares {
    void *v[PX_SPARES];
    int n;
} px_spares;
/* A zeroed block of `size` bytes (the same size on every call for one s): a
 * spare if there is one, else new. */
void *px_spare_take(px_spares *s, size_t size);
/* Keeps p (a block from px_spare_take(s, ...), or NULL) as a spare, or frees
 * it when PX_SPARES are kept. Under AddressSanitizer it always frees (the
 * sanitizer's quarantine then catches a late use of the block). */
void px_spare_put(px_spares *s, void *p);
/* Frees every spare. */
void px_spare_drain(px_spares *s);

/* A per-thread cache of freed small blocks, for the blocks a request makes
 * and frees by the dozen (libevent's buffer chains, px_buf's rooms, an
 * upstream exchange's objects). glibc's own per-thread cache keeps 7 blocks
 * of a size: with tens of requests in flight a worker frees more than that
 * in one loop turn, and the rest go through the arena's bins both ways.
 * Requests of PX_MEM_MIN to PX_MEM_MAX bytes are served in seven classes
 * (128, 192, 256, 384, 512, 768 and 1,024 bytes; a miss allocates the
 * whole class, at most a third more than asked for); smaller ones and
 * larger ones go straight to malloc. Each thread keeps up to PX_MEM_KEEP
 * blocks of a class (at most ~210 KiB a thread, also in a thread that
 * frees what others allocated) and frees them when it exits. The blocks
 * are malloc's: one taken may be given to free(), and any block from
 * malloc may be put. Under AddressSanitizer, or without glibc's
 * malloc_usable_size, nothing is kept (the sanitizer's quarantine then
 * catches a late use of a freed block, which a block handed straight to
 * the next request would hide; valgrind's memcheck would miss such a use
 * of a kept block too). */
#define PX_MEM_MIN 64
#define PX_MEM_MAX 1024
#define PX_MEM_KEEP 64
/* A block of at least n bytes; aborts on exhaustion, as px_xmalloc does. */
void *px_mem_take(size_t n);
/* The same, zeroed over its first n bytes. */
void *px_mem_zalloc(size_t n);
/* Keeps p for the calling thread's next px_mem_take of its class, or frees
 * it (a block larger than the classes, or a class already full). NULL is
 * ignored. */
void px_mem_put(void *p);
/* Blocks the calling thread keeps. */
size_t px_mem_kept(void);
/* Frees the blocks the calling thread keeps (a thread's exit does it too). */
void px_mem_drain(void);
/* libevent allocates through the cache from now on (its buffers' chains are
 * most of a request's blocks). Called once, before any other libevent call
 * of the process. */
void px_mem_for_libevent(void);

/* A growable byte buffer. `data` is owned; always NUL-terminated past `len`
 * so text can be passed to C string functions. */
typedef struct px_buf {
    char *data;
    size_t len;
    size_t cap;
} px_buf;

void px_buf_init(px_buf *b);
void px_buf_cleanup(px_buf *b);
void px_buf_reserve(px_buf *b, size_t extra);
/* Inline: most appends on the request path are a few bytes into room
 * already reserved, and a call each cost more than the copy. */
static inline void px_buf_append(px_buf *b, const void *p, size_t n) {
    if (b->len + n >= b->cap) px_buf_reserve(b, n);
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
}
static inline void px_buf_appends(px_buf *b, const char *s) {
    px_buf_append(b, s, strlen(s));
}
/* Appends v in decimal (no printf: headers are built per request). */
void px_buf_append_u64(px_buf *b, uint64_t v);
/* Percent-decodes src[0..n) into dst (cap bytes, NUL-terminated, cut to
 * fit); a '%' not followed by two hex digits stays as it is. Returns the
 * decoded length. */
size_t px_pct_decode(const char *src, size_t n, char *dst, size_t cap);
/* Writes v in decimal ending at `end` (exclusive); returns where it starts.
 * `end` must have 20 bytes before it. */
char *px_u64_dec(char *end, uint64_t v);
/* v as 16 lowercase hex digits, most significant first, in out[0..15] (no
 * NUL): what printf's "%016" PRIx64 gives, without the format parser. */
void px_hex64(char out[16], uint64_t v);
void px_buf_printf(px_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Writes v as printf's "%.2f" does, byte for byte, into out (32 bytes,
 * NUL-terminated); returns the length. Without printf for what the access
 * line carries (non-negative milliseconds); printf itself where the
 * rounding is not plain (a value within a hair of a half hundredth) or v is
 * negative, huge or not a number. */
size_t px_fmt_2dp(double v, char out[32]);
void px_buf_reset(px_buf *b);

/* Monotonic clock in nanoseconds. */
uint64_t px_now_ns(void);

/* Per-thread random numbers (xoshiro256**, seeded from getrandom). */
uint64_t px_rand64(void);

/* Writes a random RFC 4122 version-4 UUID in lowercase text (36 chars + NUL). */
void px_uuid4(char out[37]);

/* Appends `s` to `b` as a JSON string literal (with quotes), escaping as
 * RFC 8259 requires. */
void px_buf_append_json_str(px_buf *b, const char *s, size_t n);

#endif
