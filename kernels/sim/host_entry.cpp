/*
 * Host entry of the finalize kernel compiled against kernels/sim.
 *
 * amoe_finalize_kernel_host has the signature of the simulated runtime's
 * cannsim_kernel_entry: it runs one core (block) of a launch. A violation of
 * a hardware rule found by the simulation aborts that core and is reported in
 * its status record (code AMOE_FIN_ST_SIM_VIOLATION plus the message), which
 * the host reads exactly like an error flag raised by the kernel itself.
 */
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "finalize_tiling.h"
#include "kernel_operator.h"

extern "C" void amoe_finalize_kernel(GM_ADDR expandedX, GM_ADDR rowIdx, GM_ADDR x1, GM_ADDR x2, GM_ADDR bias,
                                     GM_ADDR scales, GM_ADDR expertIdx, GM_ADDR out, GM_ADDR slotOffsets,
                                     GM_ADDR status, GM_ADDR tiling);

namespace {

void ReportViolation(void *status, uint32_t block_idx, const std::string &msg)
{
    if (status == nullptr) {
        return;
    }
    uint32_t *rec = static_cast<uint32_t *>(status) + static_cast<size_t>(block_idx) * AMOE_FIN_STATUS_WORDS;
    for (uint32_t i = 0; i < AMOE_FIN_STATUS_HEAD_WORDS; ++i) {
        rec[i] = 0;
    }
    rec[AMOE_FIN_STATUS_CODE] = AMOE_FIN_ST_SIM_VIOLATION;
    char *text = reinterpret_cast<char *>(rec) + AMOE_FIN_STATUS_MESSAGE_BYTE;
    const size_t cap = AMOE_FIN_STATUS_WORDS * sizeof(uint32_t) - AMOE_FIN_STATUS_MESSAGE_BYTE;
    const size_t n = msg.size() < cap - 1 ? msg.size() : cap - 1;
    std::memcpy(text, msg.data(), n);
    text[n] = '\0';
}

/* Runs `body` as core block_idx of block_dim; returns the violation that
 * aborted it, or an empty string. */
template <typename F>
std::string RunCore(uint32_t block_idx, uint32_t block_dim, F body)
{
    amoe_sim::CoreContext &ctx = amoe_sim::Ctx();
    ctx.blockIdx = block_idx;
    ctx.blockNum = block_dim;
    ctx.active = true;
    ctx.pipe = nullptr;
    ctx.deferred.clear();
    AscendC::CurrentPipe() = nullptr;
    std::string violation;
    try {
        body();
    } catch (const amoe_sim::Violation &v) {
        violation = v.what();
    } catch (const std::exception &e) {
        violation = std::string("unexpected exception: ") + e.what();
    } catch (...) {
        violation = "unexpected exception";
    }
    if (violation.empty() && !ctx.deferred.empty()) {
        violation = ctx.deferred;
    }
    ctx.active = false;
    ctx.pipe = nullptr;
    AscendC::CurrentPipe() = nullptr;
    return violation;
}

} // namespace

extern "C" void amoe_finalize_kernel_host(uint32_t block_idx, uint32_t block_dim, void *const *gm,
                                          const void *tiling)
{
    if (gm == nullptr) {
        return;
    }
    void *status = gm[AMOE_FIN_GM_STATUS];
    if (block_idx >= block_dim) {
        return; /* no record to write: the status array has block_dim records */
    }
    std::string violation = RunCore(block_idx, block_dim, [&]() {
        if (tiling == nullptr || status == nullptr) {
            amoe_sim::Fail("launch: null tiling or status pointer");
        }
        auto p = [gm](int i) { return static_cast<GM_ADDR>(gm[i]); };
        amoe_finalize_kernel(p(AMOE_FIN_GM_EXPANDED_X), p(AMOE_FIN_GM_ROW_IDX), p(AMOE_FIN_GM_X1), p(AMOE_FIN_GM_X2),
                             p(AMOE_FIN_GM_BIAS), p(AMOE_FIN_GM_SCALES), p(AMOE_FIN_GM_EXPERT_IDX),
                             p(AMOE_FIN_GM_OUT), p(AMOE_FIN_GM_SLOT_OFFSETS), p(AMOE_FIN_GM_STATUS),
                             static_cast<GM_ADDR>(const_cast<void *>(tiling)));
    });
    if (!violation.empty()) {
        ReportViolation(status, block_idx, "block " + std::to_string(block_idx) + ": " + violation);
    }
}

namespace {

using namespace AscendC;

/* Small kernels that break one rule each (case 0 breaks none), to show the
 * simulation catches what the finalize kernel itself never does. */
void SelftestKernel(uint32_t which)
{
    alignas(32) static thread_local float gmData[64];
    GlobalTensor<float> gm;
    gm.SetGlobalBuffer(gmData, 64);
    TPipe pipe;
    TQue<QuePosition::VECIN, 1> que;
    pipe.InitBuffer(que, 1, 64 * sizeof(float));
    LocalTensor<float> t = que.AllocTensor<float>();
    switch (which) {
    case 0: /* balanced and aligned */
        DataCopy(t, gm, 64);
        que.EnQue(t);
        t = que.DeQue<float>();
        Add(t, t, t, 64);
        que.FreeTensor(t);
        return;
    case 1: /* a second AllocTensor on a one-buffer queue */
        que.AllocTensor<float>();
        return;
    case 2: /* DeQue with nothing enqueued */
        que.DeQue<float>();
        return;
    case 3: /* returns with the tensor still allocated */
        return;
    case 4: /* use after FreeTensor */
        que.FreeTensor(t);
        Duplicate(t, 1.0f, 8);
        return;
    case 5: /* vector op past the end of the tensor */
        Add(t, t, t, 65);
        que.FreeTensor(t);
        return;
    case 6: /* read past the global buffer */
        DataCopy(t, gm[32], 64);
        que.FreeTensor(t);
        return;
    case 7: /* UB address not 32-byte aligned */
        DataCopy(t[4], gm, 8);
        que.FreeTensor(t);
        return;
    case 8: /* FreeTensor of an enqueued tensor */
        que.EnQue(t);
        que.FreeTensor(t);
        return;
    default:
        que.FreeTensor(t);
        amoe_sim::Fail("selftest: unknown case %u", which);
    }
}

} // namespace

/* Runs self-test kernel `which` on one core; writes the violation message
 * (empty when none) into msg and returns 1 if the run was aborted. */
extern "C" int amoe_sim_selftest(uint32_t which, char *msg, size_t cap)
{
    std::string v = RunCore(0, 1, [which]() { SelftestKernel(which); });
    if (msg != nullptr && cap > 0) {
        size_t n = v.size() < cap - 1 ? v.size() : cap - 1;
        std::memcpy(msg, v.data(), n);
        msg[n] = '\0';
    }
    return v.empty() ? 0 : 1;
}

/* Byte offsets of every AmoeFinalizeTiling field, in declaration order,
 * followed by sizeof; returns how many values it would write. */
extern "C" size_t amoe_finalize_tiling_layout(uint32_t *out, size_t cap)
{
    const uint32_t v[] = {
        offsetof(AmoeFinalizeTiling, magic),         offsetof(AmoeFinalizeTiling, n),
        offsetof(AmoeFinalizeTiling, k),             offsetof(AmoeFinalizeTiling, h),
        offsetof(AmoeFinalizeTiling, expanded_rows), offsetof(AmoeFinalizeTiling, experts),
        offsetof(AmoeFinalizeTiling, data_dtype),    offsetof(AmoeFinalizeTiling, scales_dtype),
        offsetof(AmoeFinalizeTiling, mode),          offsetof(AmoeFinalizeTiling, flags),
        offsetof(AmoeFinalizeTiling, block_dim),     offsetof(AmoeFinalizeTiling, out_rows),
        offsetof(AmoeFinalizeTiling, slots),         offsetof(AmoeFinalizeTiling, slot_rows),
        offsetof(AmoeFinalizeTiling, tile_h),        offsetof(AmoeFinalizeTiling, tiles),
        offsetof(AmoeFinalizeTiling, tail_h),        offsetof(AmoeFinalizeTiling, rows_per_core),
        offsetof(AmoeFinalizeTiling, rows_rem),      offsetof(AmoeFinalizeTiling, ub_bytes),
        sizeof(AmoeFinalizeTiling),
    };
    const size_t n = sizeof(v) / sizeof(v[0]);
    for (size_t i = 0; i < n && i < cap && out != nullptr; ++i) {
        out[i] = v[i];
    }
    return n;
}

/* The UB bytes the kernel allocates for a tile (the header's formula), so the
 * Rust tiling can be checked against it. */
extern "C" uint32_t amoe_finalize_ub_bytes_host(uint32_t data_dtype, uint32_t tile_h)
{
    return amoe_finalize_ub_bytes(data_dtype, tile_h);
}

/* Unified-buffer capacity the simulation enforces per core. */
extern "C" uint32_t amoe_sim_ub_capacity(void) { return AMOE_SIM_UB_BYTES; }
