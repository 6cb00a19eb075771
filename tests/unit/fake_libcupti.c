/* A fake libcupti for CPU tests of distanom's ctypes binding (tests/unit/test_cupti_lib.py).
 *
 * It implements the CUPTI functions distanom calls with CUPTI's signatures and result
 * codes, asks for buffers through the registered request callback, hands them back
 * through the completion callback, and lays records out as CUPTI 13.0 does
 * (CUpti_ActivityKernel10: 216 bytes). fake_* functions are test hooks.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*request_fn)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*complete_fn)(void *ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid);

static request_fn g_request;
static complete_fn g_complete;
static int g_enabled[64];
static int g_busy, g_subscribed, g_fail_enable = -1;
static uint8_t *g_buf;
static size_t g_size, g_used, g_dropped;
static uint32_t g_corr = 100;
static int g_finalized, g_fail_finalize;

int cuptiGetResultString(int result, const char **str) {
    if (!str) return 1;
    switch (result) {
    case 0: *str = "CUPTI_SUCCESS"; return 0;
    case 7: *str = "CUPTI_ERROR_INVALID_OPERATION"; return 0;
    case 21: *str = "CUPTI_ERROR_INVALID_KIND"; return 0;
    case 39: *str = "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"; return 0;
    default: return 1;
    }
}
int cuptiGetVersion(uint32_t *v) { *v = 130001; return 0; }
int cuptiGetTimestamp(uint64_t *t) { *t = 1800000000000000000ull; return 0; }
int cuptiActivityRegisterCallbacks(request_fn r, complete_fn c) {
    if (!r || !c) return 1;
    g_request = r; g_complete = c; return 0;
}
int cuptiActivityEnable(int kind) {
    if (kind == g_fail_enable || kind < 0 || kind >= 64) return 21;
    g_enabled[kind] = 1; return 0;
}
int cuptiActivityDisable(int kind) {
    if (kind < 0 || kind >= 64) return 21;
    g_enabled[kind] = 0; return 0;
}
static void complete_current(void) {
    if (g_buf) { g_complete(NULL, 0, g_buf, g_size, g_used); g_buf = NULL; }
}
int cuptiActivityFlushAll(uint32_t flag) {
    (void)flag;
    if (!g_complete) return 7;
    complete_current();
    return 0;
}
int cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, uint8_t **record) {
    size_t off = 0;
    if (!buffer || !record) return 1;
    if (*record) {
        int32_t kind;
        memcpy(&kind, *record, 4);
        off = (size_t)(*record - buffer) + (kind == 10 ? 216 : kind == 1 ? 96 : kind == 2 ? 88 : 0);
        if (off == (size_t)(*record - buffer)) return 21;
    }
    if (off >= valid) return 12; /* CUPTI_ERROR_MAX_LIMIT_REACHED */
    *record = buffer + off;
    return 0;
}
int cuptiActivityGetNumDroppedRecords(void *ctx, uint32_t stream, size_t *dropped) {
    (void)ctx; (void)stream;
    if (!dropped) return 1;
    *dropped = g_dropped; g_dropped = 0; return 0;
}
int cuptiSubscribe(void **handle, void *callback, void *userdata) {
    (void)callback; (void)userdata;
    if (g_busy || g_subscribed) return 39;
    g_subscribed = 1; *handle = (void *)0x1; return 0;
}
int cuptiUnsubscribe(void *handle) { (void)handle; g_subscribed = 0; return 0; }
/* Detach: CUPTI forgets its callbacks, kinds and any buffer it still holds; correlation
 * ids start again (the worst case distanom must handle). */
int cuptiFinalize(void) {
    if (g_fail_finalize) return 7;
    g_request = NULL; g_complete = NULL; g_buf = NULL;
    memset(g_enabled, 0, sizeof g_enabled);
    g_corr = 100;
    g_finalized++;
    return 0;
}

/* -- test hooks ---------------------------------------------------------------------- */
void fake_set_busy(int busy) { g_busy = busy; }
void fake_fail_enable(int kind) { g_fail_enable = kind; }
int fake_enabled(int kind) { return g_enabled[kind]; }
int fake_subscribed(void) { return g_subscribed; }
int fake_finalized(void) { return g_finalized; }
void fake_fail_finalize(int fail) { g_fail_finalize = fail; }

/* Emit a kernel record; returns its correlation id, -1 if kernels are not enabled,
 * -2 if no buffer could be had (the record is dropped, as CUPTI would). */
int fake_emit_kernel(uint64_t start, uint64_t end, const char *name, int32_t grid_x) {
    size_t max_records = 0;
    uint32_t corr;
    int32_t kind = 10, block_x = 128;
    uint64_t name_ptr = (uint64_t)(uintptr_t)name;
    uint8_t *r;
    if (!g_enabled[10]) return -1;
    if (g_buf && g_used + 216 > g_size) complete_current();
    if (!g_buf) {
        g_request(&g_buf, &g_size, &max_records);
        g_used = 0;
        if (!g_buf || g_size < 216) { g_buf = NULL; g_dropped++; return -2; }
    }
    r = g_buf + g_used;
    memset(r, 0, 216);
    corr = ++g_corr;
    memcpy(r, &kind, 4);
    memcpy(r + 16, &start, 8);
    memcpy(r + 24, &end, 8);
    memcpy(r + 52, &grid_x, 4);
    memcpy(r + 64, &block_x, 4);
    memcpy(r + 92, &corr, 4);
    memcpy(r + 104, &name_ptr, 8);
    g_used += 216;
    return (int)corr;
}
