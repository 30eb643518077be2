/*
 * Host model of one Atlas A2 (dav-c220) vector core, under the real Ascend C
 * headers of CANN in CPU-debug mode (see kernels/README.md).
 *
 * In CPU-debug mode the headers lower every API call to the intrinsics of
 * tikicpulib's stub_fun.h (copy_gm_to_ubuf, vadd, vconv_*, set_flag, ...)
 * and to a few runtime hooks (AscendCBuf*, block_idx, the check functions).
 * model.cpp implements them over host memory and enforces the rules the
 * hardware enforces; this header is the interface the host entry uses to
 * run one core under the model.
 */
#ifndef AMOE_HOST_MODEL_H
#define AMOE_HOST_MODEL_H

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace amoe_hm {

/* A broken hardware rule; aborts the core that broke it. */
struct Violation : std::runtime_error {
    explicit Violation(const std::string &m) : std::runtime_error(m) {}
};

[[noreturn]] void Fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Unified buffer of one vector core, bytes (the CPU-debug headers' UB pool
 * for __CCE_AICORE__ == 220 has the same size). */
constexpr uint64_t kUbBytes = 192u * 1024u;

/* One global-memory buffer a core may access through the MTE pipes. */
struct GmRange {
    const void *base;
    uint64_t bytes;
    const char *name;
};

/* Runs `body` as core block_idx of a block_dim launch under the model, one
 * core at a time in the process (the CPU-debug headers keep the unified
 * buffer and the pipe in process-wide singletons). GM copies must stay
 * inside `gm[0..gm_count)`. Returns the violation that aborted the core, or
 * an empty string. */
std::string RunCore(uint32_t block_idx, uint32_t block_dim, const GmRange *gm, size_t gm_count, void (*body)(void *),
                    void *ctx);

} // namespace amoe_hm

#endif
