/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA runtime, loaded on first use instead of linked: one libkvconnector
 * serves hosts with and without CUDA.  cuda.c is written against
 * <cuda_runtime_api.h> as usual; the runtime functions it calls are defined
 * here, hidden (never exported, never interposed), each calling through a
 * pointer that the first call fills with dlopen + dlsym.  When the runtime
 * cannot be loaded every call answers cudaErrorInsufficientDriver, which
 * cuda.c already treats as "no usable device" (KVC_ERR_NO_DEVICE), and the
 * error name says which library was looked for and why it did not load.
 *
 * Which library: $KVC_CUDART_LIBRARY when set (a path or a soname), else
 * libcudart.so.<major> of the headers this was built with.  Inside an engine
 * that has loaded the runtime already (torch), dlopen by soname returns that
 * very copy: one runtime per process.
 *
 * A cuda* function that cuda.c starts to call needs a line in FUNCS below;
 * the link (-Wl,--no-undefined) and test_kvc_cudart.sh fail until it has
 * one, and a wrong signature does not compile (the header declares each). */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STR_(x) #x
#define STR(x) STR_(x)

/* X(return type, name, (parameters), (arguments)) */
#define FUNCS(X)                                                                                   \
    X(cudaError_t, cudaGetDeviceCount, (int *count), (count))                                      \
    X(cudaError_t, cudaGetDevice, (int *device), (device))                                         \
    X(cudaError_t, cudaSetDevice, (int device), (device))                                          \
    X(cudaError_t, cudaGetLastError, (void), ())                                                   \
    X(cudaError_t, cudaGetDriverEntryPointByVersion,                                               \
      (const char *symbol, void **fn, unsigned int version, unsigned long long flags,              \
       enum cudaDriverEntryPointQueryResult *status),                                              \
      (symbol, fn, version, flags, status))                                                        \
    X(cudaError_t, cudaPointerGetAttributes,                                                       \
      (struct cudaPointerAttributes * attributes, const void *ptr), (attributes, ptr))             \
    X(cudaError_t, cudaHostRegister, (void *ptr, size_t size, unsigned int flags),                 \
      (ptr, size, flags))                                                                          \
    X(cudaError_t, cudaHostUnregister, (void *ptr), (ptr))                                         \
    X(cudaError_t, cudaStreamCreateWithFlags, (cudaStream_t * stream, unsigned int flags),         \
      (stream, flags))                                                                             \
    X(cudaError_t, cudaStreamDestroy, (cudaStream_t stream), (stream))                             \
    X(cudaError_t, cudaStreamSynchronize, (cudaStream_t stream), (stream))                         \
    X(cudaError_t, cudaStreamWaitEvent,                                                            \
      (cudaStream_t stream, cudaEvent_t event, unsigned int flags), (stream, event, flags))        \
    X(cudaError_t, cudaEventCreateWithFlags, (cudaEvent_t * event, unsigned int flags),            \
      (event, flags))                                                                              \
    X(cudaError_t, cudaEventDestroy, (cudaEvent_t event), (event))                                 \
    X(cudaError_t, cudaEventQuery, (cudaEvent_t event), (event))                                   \
    X(cudaError_t, cudaEventSynchronize, (cudaEvent_t event), (event))                             \
    X(cudaError_t, cudaEventRecord, (cudaEvent_t event, cudaStream_t stream), (event, stream))     \
    X(cudaError_t, cudaMemcpyAsync,                                                                \
      (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream),   \
      (dst, src, count, kind, stream))                                                            \
    X(cudaError_t, cudaMemcpy2DAsync,                                                              \
      (void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,      \
       enum cudaMemcpyKind kind, cudaStream_t stream),                                             \
      (dst, dpitch, src, spitch, width, height, kind, stream))                                    \
    X(cudaError_t, cudaIpcGetMemHandle, (cudaIpcMemHandle_t * handle, void *devPtr),              \
      (handle, devPtr))                                                                            \
    X(cudaError_t, cudaIpcOpenMemHandle,                                                           \
      (void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags), (devPtr, handle, flags))     \
    X(cudaError_t, cudaIpcCloseMemHandle, (void *devPtr), (devPtr))                               \
    X(cudaError_t, cudaDeviceGetPCIBusId, (char *pciBusId, int len, int device),                  \
      (pciBusId, len, device))

#define POINTER(ret, name, params, args) static ret(*p_##name) params;
FUNCS(POINTER)
static const char *(*p_cudaGetErrorName)(cudaError_t);
static const char *(*p_cudaGetErrorString)(cudaError_t);

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int loaded;
static char why[512]; /* the error name when the runtime did not load */

#define RESOLVE(ret, name, params, args)                                                           \
    if (ok && !(sym = dlsym(h, STR(name)))) ok = 0, missing = STR(name);                           \
    if (ok) memcpy(&p_##name, &sym, sizeof sym);

static void load(void) {
    char soname[64];
    snprintf(soname, sizeof soname, "libcudart.so.%d", CUDART_VERSION / 1000);
    const char *env = getenv("KVC_CUDART_LIBRARY");
    const char *lib = env && *env ? env : soname;
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(why, sizeof why, "cudaErrorInsufficientDriver: the CUDA runtime %s did not load (%s)",
                 lib, e ? e : "dlopen failed");
        return;
    }
    void *sym;
    int ok = 1;
    const char *missing = NULL;
    FUNCS(RESOLVE)
    RESOLVE(const char *, cudaGetErrorName, , )
    RESOLVE(const char *, cudaGetErrorString, , )
    if (!ok) {
        snprintf(why, sizeof why, "cudaErrorInsufficientDriver: the CUDA runtime %s lacks %s", lib,
                 missing);
        dlclose(h);
        return;
    }
    loaded = 1; /* kept loaded for the life of the process */
}

static int ready(void) {
    pthread_once(&once, load);
    return loaded;
}

#define DEFINE(ret, name, params, args)                                                            \
    ret name params {                                                                              \
        return ready() ? p_##name args : cudaErrorInsufficientDriver;                              \
    }
FUNCS(DEFINE)

const char *cudaGetErrorName(cudaError_t e) {
    return ready() ? p_cudaGetErrorName(e) : why;
}

const char *cudaGetErrorString(cudaError_t e) {
    return ready() ? p_cudaGetErrorString(e) : why;
}
