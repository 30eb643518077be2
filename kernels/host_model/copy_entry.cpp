/*
 * Host entry of the byte-copy kernel (copy_kernel.cpp) under the host model.
 *
 * amoe_copy_kernel_host has the signature of the simulated runtime's
 * cannsim_kernel_entry_ex: it runs one core of a launch and returns nonzero,
 * with the message in `msg`, when the core was aborted (a broken hardware
 * rule found by the model, or the kernel's own Trap). The simulated runtime
 * then fails the stream with an AI Core exception, as the hardware does;
 * the kernel has no status record.
 */
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "copy_tiling.h"
#include "kernel_operator.h"
#include "model.h"

extern "C" void amoe_copy_kernel(GM_ADDR dst, GM_ADDR src, uint64_t len, uint64_t per_core, uint32_t tile,
                                 uint32_t dst_phase, uint32_t magic);

namespace {

struct CopyLaunch {
    void *const *gm;
    AmoeCopyTiling t;
};

void RunCopy(void *ctx)
{
    const CopyLaunch &l = *static_cast<const CopyLaunch *>(ctx);
    amoe_copy_kernel(static_cast<GM_ADDR>(l.gm[AMOE_COPY_GM_DST]), static_cast<GM_ADDR>(l.gm[AMOE_COPY_GM_SRC]),
                     l.t.len, l.t.per_core, l.t.tile, l.t.dst_phase, l.t.magic);
}

int32_t Report(char *msg, size_t cap, const std::string &text)
{
    if (msg != nullptr && cap > 0) {
        const size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
        std::memcpy(msg, text.data(), n);
        msg[n] = '\0';
    }
    return 1;
}

} // namespace

/* One core of a copy launch. The model lets the core touch exactly the
 * `len` bytes at dst and at src. */
extern "C" int32_t amoe_copy_kernel_host(uint32_t block_idx, uint32_t block_dim, void *const *gm, const void *tiling,
                                         char *msg, size_t cap)
{
    if (gm == nullptr || tiling == nullptr || gm[AMOE_COPY_GM_DST] == nullptr || gm[AMOE_COPY_GM_SRC] == nullptr) {
        return Report(msg, cap, "launch: a NULL gm array, tiling, dst or src");
    }
    CopyLaunch l{gm, {}};
    std::memcpy(&l.t, tiling, sizeof(l.t));
    const amoe_hm::GmRange ranges[AMOE_COPY_GM_COUNT] = {
        {gm[AMOE_COPY_GM_DST], l.t.len, "dst"},
        {gm[AMOE_COPY_GM_SRC], l.t.len, "src"},
    };
    const std::string violation = amoe_hm::RunCore(block_idx, block_dim, ranges, AMOE_COPY_GM_COUNT, RunCopy, &l);
    if (violation.empty()) {
        return 0;
    }
    return Report(msg, cap, "block " + std::to_string(block_idx) + ": " + violation);
}

/* Byte offsets of AmoeCopyTiling's fields, then its sizeof. */
extern "C" size_t amoe_copy_tiling_layout(uint32_t *out, size_t cap)
{
    const uint32_t v[] = {
        offsetof(AmoeCopyTiling, magic),    offsetof(AmoeCopyTiling, block_dim), offsetof(AmoeCopyTiling, tile),
        offsetof(AmoeCopyTiling, dst_phase), offsetof(AmoeCopyTiling, len),      offsetof(AmoeCopyTiling, per_core),
        sizeof(AmoeCopyTiling),
    };
    const size_t n = sizeof(v) / sizeof(v[0]);
    for (size_t i = 0; i < n && i < cap && out != nullptr; ++i) {
        out[i] = v[i];
    }
    return n;
}
