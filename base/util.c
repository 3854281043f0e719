/* SPDX-License-Identifier: Apache-2.0 */
#include "base/util.h"

#include <event2/event.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define PX_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PX_ASAN 1
#endif
#endif
#if defined(__GLIBC__) && !defined(PX_ASAN)
#include <malloc.h>
#define PX_MEM_CACHE 1
#endif

static void oom(size_t n) {
    fprintf(stderr, "pdproxy: out of memory allocating %zu bytes\n", n);
    abort();
}

void *px_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) oom(n);
    return p;
}

/* glibc's calloc (before 2.41) never takes a block from the thread's cache
 * of freed small blocks (tcache); malloc does, so a small zeroed block is
 * malloc's and a memset: half the instructions of a request's objects, and
 * no trip through the arena's bins. Large blocks keep calloc, which can
 * skip zeroing pages fresh from the kernel. */
#define SMALL_ZEROED 1008
void *px_xcalloc(size_t n, size_t size) {
    size_t total;
    if (!n) n = 1;
    if (!size) size = 1;
    if (__builtin_mul_overflow(n, size, &total)) oom(SIZE_MAX);
    void *p;
    if (total <= SMALL_ZEROED) {
        p = malloc(total);
        /* GCC turns a malloc followed by a memset to zero back into calloc
         * unless something in between might write memory. */
        __asm__ volatile("" : : "r"(p) : "memory");
        if (p) memset(p, 0, total);
    } else {
        p = calloc(n, size);
    }
    if (!p) oom(total);
    return p;
}


void *px_spare_take(px_spares *s, size_t size) {
    if (!s->n) return px_xcalloc(1, size);
    return memset(s->v[--s->n], 0, size);
}

void px_spare_put(px_spares *s, void *p) {
    if (!p) return;
#ifndef PX_ASAN
    if (s->n < PX_SPARES) {
        s->v[s->n++] = p;
        return;
    }
#endif
    /* Full, or under AddressSanitizer, whose quarantine keeps a freed block
     * out of use for long so that a late use is caught (a spare handed to
     * the next request at once would let a stale pointer reach a live
     * request instead). */
    free(p);
}

void px_spare_drain(px_spares *s) {
    while (s->n)
        free(s->v[--s->n]);
}

#ifdef PX_MEM_CACHE
typedef struct mem_class {
    void *v[PX_MEM_KEEP];
    int n;
} mem_class;
#define MEM_CLASSES 7
static _Thread_local mem_class mem_kept[MEM_CLASSES]; /* 128, 192, 256, 384, 512, 768, 1024 */
static _Thread_local int mem_state;         /* 0: unknown, 1: drained at exit, -1: no key */
static pthread_key_t mem_key;
static int mem_key_ok;
static pthread_once_t mem_once = PTHREAD_ONCE_INIT;

static void mem_exit(void *unused) {
    (void)unused;
    mem_state = -1; /* a block put by a later destructor is freed */
    px_mem_drain();
}

static void mem_key_init(void) {
    mem_key_ok = pthread_key_create(&mem_key, mem_exit) == 0;
}

static const size_t mem_size[MEM_CLASSES] = {128, 192, 256, 384, 512, 768, 1024};

/* Bits needed to write v (v > 0). */
static int bit_len(size_t v) {
    return (int)(sizeof(unsigned long long) * 8) - __builtin_clzll((unsigned long long)v);
}

/* The smallest class of at least n bytes (PX_MEM_MIN < n <= PX_MEM_MAX):
 * each power of two from 128 and the one and a half between them, so no
 * block is more than a third larger than asked for. */
static int class_for(size_t n) {
    if (n <= 128) return 0;
    int b = bit_len(n - 1); /* 2^(b-1) < n <= 2^b */
    size_t half = (size_t)1 << (b - 1);
    return 2 * (b - 8) + (n <= half + half / 2 ? 1 : 2);
}

/* The largest class of at most u bytes (128 <= u < 1536): where a block of
 * u usable bytes can serve. */
static int class_of(size_t u) {
    int b = bit_len(u); /* 2^(b-1) <= u < 2^b */
    size_t low = (size_t)1 << (b - 1);
    return 2 * (b - 8) + (u >= low + low / 2);
}
#endif

/* px_mem_take, or NULL when memory is exhausted (libevent's contract). */
static void *mem_take(size_t n) {
#ifdef PX_MEM_CACHE
    if (n > PX_MEM_MIN && n <= PX_MEM_MAX) {
        int k = class_for(n);
        mem_class *m = &mem_kept[k];
        if (m->n) return m->v[--m->n];
        return malloc(mem_size[k]); /* the whole class, so it comes back to it */
    }
#endif
    return malloc(n ? n : 1);
}

void *px_mem_take(size_t n) {
    void *p = mem_take(n);
    if (!p) oom(n);
    return p;
}

void *px_mem_zalloc(size_t n) {
    return memset(px_mem_take(n), 0, n);
}

void px_mem_put(void *p) {
    if (!p) return;
#ifdef PX_MEM_CACHE
    /* Kept in the largest class the block can serve; a block of 1.5 KiB
     * or more is not hoarded as a small one. */
    size_t u = malloc_usable_size(p);
    if (u >= 128 && u < 1536) {
        int k = class_of(u);
        if (mem_kept[k].n < PX_MEM_KEEP) {
            if (mem_state == 0) { /* the thread's first: free them at its exit */
                pthread_once(&mem_once, mem_key_init);
                mem_state = mem_key_ok && pthread_setspecific(mem_key, &mem_state) == 0 ? 1 : -1;
            }
            if (mem_state == 1) {
                mem_kept[k].v[mem_kept[k].n++] = p;
                return;
            }
        }
    }
#endif
    free(p);
}

size_t px_mem_kept(void) {
    size_t n = 0;
#ifdef PX_MEM_CACHE
    for (int k = 0; k < MEM_CLASSES; k++)
        n += (size_t)mem_kept[k].n;
#endif
    return n;
}

void px_mem_drain(void) {
#ifdef PX_MEM_CACHE
    for (int k = 0; k < MEM_CLASSES; k++)
        while (mem_kept[k].n)
            free(mem_kept[k].v[--mem_kept[k].n]);
#endif
}

void px_mem_for_libevent(void) {
#ifdef PX_MEM_CACHE
    event_set_mem_functions(mem_take, realloc, px_mem_put);
#endif
}

void *px_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) oom(n);
    return q;
}

char *px_xstrdup(const char *s) {
    return px_xstrndup(s, strlen(s));
}

size_t px_strncpyz(char *out, size_t cap, const char *s, size_t n) {
    if (!cap) return 0;
    const char *z = memchr(s, 0, n);
    if (z) n = (size_t)(z - s);
    if (n > cap - 1) n = cap - 1;
    memcpy(out, s, n);
    out[n] = 0;
    return n;
}

char *px_xstrndup(const char *s, size_t n) {
    char *p = px_xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

void px_buf_init(px_buf *b) {
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
}

void px_buf_cleanup(px_buf *b) {
    px_mem_put(b->data);
    px_buf_init(b);
}

void px_buf_reset(px_buf *b) {
    b->len = 0;
    if (b->data) b->data[0] = '\0';
}

void px_buf_reserve(px_buf *b, size_t extra) {
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need)
        cap *= 2;
    if (!b->data)
        b->data = px_mem_take(cap); /* 256, 512, 1024: a class of the cache */
    else
        b->data = px_xrealloc(b->data, cap);
    b->cap = cap;
}

char *px_u64_dec(char *end, uint64_t v) {
    do {
        *--end = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return end;
}

void px_hex64(char out[16], uint64_t v) {
#ifdef __SSE2__
    /* The 8 bytes most significant first, each split into its two nibbles
     * (high, low), interleaved into 16 digit values; '0' added to each and
     * 'a' - '0' - 10 more to those above 9. */
    uint64_t be = __builtin_bswap64(v);
    __m128i x = _mm_loadl_epi64((const __m128i *)(const void *)&be);
    __m128i lo = _mm_and_si128(x, _mm_set1_epi8(15));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(x, 4), _mm_set1_epi8(15));
    __m128i d = _mm_unpacklo_epi8(hi, lo);
    __m128i letter = _mm_and_si128(_mm_cmpgt_epi8(d, _mm_set1_epi8(9)), _mm_set1_epi8('a' - '0' - 10));
    d = _mm_add_epi8(_mm_add_epi8(d, _mm_set1_epi8('0')), letter);
    _mm_storeu_si128((__m128i *)(void *)out, d);
#else
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++)
        out[i] = hex[(v >> (60 - 4 * i)) & 15];
#endif
}

void px_buf_append_u64(px_buf *b, uint64_t v) {
    char d[20];
    char *s = px_u64_dec(d + sizeof d, v);
    px_buf_append(b, s, (size_t)(d + sizeof d - s));
}

static int hexval(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

size_t px_pct_decode(const char *src, size_t n, char *dst, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n && o + 1 < cap; i++) {
        int hi, lo;
        if (src[i] == '%' && i + 2 < n && (hi = hexval(src[i + 1])) >= 0 &&
            (lo = hexval(src[i + 2])) >= 0) {
            dst[o++] = (char)(hi << 4 | lo);
            i += 2;
        } else {
            dst[o++] = src[i];
        }
    }
    if (cap) dst[o] = '\0';
    return o;
}

void px_buf_printf(px_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char tmp[256];
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        px_buf_append(b, tmp, (size_t)n);
        return;
    }
    px_buf_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

size_t px_fmt_2dp(double v, char out[32]) {
    /* Below 2^33 the product v * 100 is off v's exact hundredfold by at
     * most 2^-14: only a product within 2^-10 of a half could round
     * otherwise than printf's exact decimal expansion does; those, and
     * exact ties (printf rounds them to even), go to printf. */
    if (!signbit(v) && v < 8589934592.0) {
        double s = v * 100.0;
        uint64_t i = (uint64_t)s;
        double f = s - (double)i;
        if (fabs(f - 0.5) > 1.0 / 1024) {
            uint64_t h = i + (f > 0.5);
            char tmp[24], *e = tmp + sizeof tmp;
            *--e = (char)('0' + h % 10);
            *--e = (char)('0' + h / 10 % 10);
            *--e = '.';
            char *b = px_u64_dec(e, h / 100);
            size_t n = (size_t)(tmp + sizeof tmp - b);
            memcpy(out, b, n);
            out[n] = '\0';
            return n;
        }
    }
    int n = snprintf(out, 32, "%.2f", v);
    return n < 0 ? 0 : (size_t)n < 32 ? (size_t)n : 31;
}

uint64_t px_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static _Thread_local uint64_t rng[4];
static _Thread_local int rng_seeded;

static inline uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t px_rand64(void) {
    if (!rng_seeded) {
        if (getrandom(rng, sizeof rng, 0) != (ssize_t)sizeof rng) {
            /* getrandom on Linux ≥ 3.17 does not fail for 32 bytes; keep a
             * usable, if weaker, seed anyway. */
            uint64_t t = px_now_ns();
            for (int i = 0; i < 4; i++)
                rng[i] = t * 0x9e3779b97f4a7c15ull + (uint64_t)i;
        }
        rng_seeded = 1;
    }
    uint64_t result = rotl(rng[1] * 5, 7) * 9;
    uint64_t t = rng[1] << 17;
    rng[2] ^= rng[0];
    rng[3] ^= rng[1];
    rng[1] ^= rng[2];
    rng[0] ^= rng[3];
    rng[2] ^= t;
    rng[3] = rotl(rng[3], 45);
    return result;
}

void px_uuid4(char out[37]) {
    uint8_t b[16];
    uint64_t a = px_rand64(), c = px_rand64();
    memcpy(b, &a, 8);
    memcpy(b + 8, &c, 8);
    b[6] = (uint8_t)((b[6] & 0x0f) | 0x40);
    b[8] = (uint8_t)((b[8] & 0x3f) | 0x80);
    static const char hex[] = "0123456789abcdef";
    int o = 0;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) out[o++] = '-';
        out[o++] = hex[b[i] >> 4];
        out[o++] = hex[b[i] & 15];
    }
    out[o] = '\0';
}

void px_buf_append_json_str(px_buf *b, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    px_buf_reserve(b, n + 2);
    px_buf_append(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            px_buf_append(b, e, 2);
        } else if (c < 0x20) {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            px_buf_append(b, e, 6);
        } else {
            px_buf_append(b, &s[i], 1);
        }
    }
    px_buf_append(b, "\"", 1);
}
