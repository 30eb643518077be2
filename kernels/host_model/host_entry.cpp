/*
 * Host entry of the finalize kernel compiled against the real Ascend C
 * headers in CPU-debug mode, over the host model (model.cpp).
 *
 * amoe_finalize_kernel_host has the signature of the simulated runtime's
 * cannsim_kernel_entry: it runs one core (block) of a launch. A violation of
 * a hardware rule found by the model aborts that core and is reported in its
 * status record (code AMOE_FIN_ST_SIM_VIOLATION plus the message), which the
 * host reads exactly like an error flag raised by the kernel itself.
 *
 * This file also implements the AscendC::check functions the CPU-debug
 * headers call before an API lowers to its intrinsics (they need the
 * headers' parameter structs), and small rule-breaking kernels that show the
 * model catches what the finalize kernel never does.
 */
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "finalize_tiling.h"
#include "guard_tiling.h"
#include "kernel_operator.h"
#include "model.h"

extern "C" void amoe_finalize_kernel(GM_ADDR expandedX, GM_ADDR rowIdx, GM_ADDR x1, GM_ADDR x2, GM_ADDR bias,
                                     GM_ADDR scales, GM_ADDR expertIdx, GM_ADDR out, GM_ADDR slotOffsets,
                                     GM_ADDR status, GM_ADDR tiling);
extern "C" void amoe_finalize_kernel_dropped_barrier(GM_ADDR expandedX, GM_ADDR rowIdx, GM_ADDR x1, GM_ADDR x2,
                                                     GM_ADDR bias, GM_ADDR scales, GM_ADDR expertIdx, GM_ADDR out,
                                                     GM_ADDR slotOffsets, GM_ADDR status, GM_ADDR tiling);
extern "C" void amoe_guard_kernel(GM_ADDR live, GM_ADDR status, GM_ADDR tiling);

/* ---- AscendC::check: the API-level checks of the CPU-debug build ---- */

namespace AscendC {
namespace check {
namespace {
void CountFits(const char *api, uint64_t count, uint32_t dtypeBytes, uint64_t sizeBytes, const char *operand)
{
    if (dtypeBytes != 0 && count * dtypeBytes > sizeBytes) {
        amoe_hm::Fail("%s: calCount %llu is outside the %llu-element %s tensor", api,
                      static_cast<unsigned long long>(count), static_cast<unsigned long long>(sizeBytes / dtypeBytes),
                      operand);
    }
}
} // namespace

bool CheckFuncVecBinaryImpl(VecBinaryApiParams &p, const char *name)
{
    CountFits(name, p.calCount, p.dstDtypeBytes, p.dstSize, "dst");
    CountFits(name, p.calCount, p.src0DtypeBytes, p.src0Size, "src0");
    CountFits(name, p.calCount, p.src1DtypeBytes, p.src1Size, "src1");
    return true;
}

bool CheckFunVecBinaryScalarImpl(VecBinaryScalarApiParams &p, const char *name)
{
    CountFits(name, p.calCount, p.dstDtypeBytes, p.dstSize, "dst");
    CountFits(name, p.calCount, p.src0DtypeBytes, p.src0Size, "src");
    return true;
}

bool CheckFunDupImpl(VecDupApiParams &p, const char *name)
{
    CountFits(name, p.calCount, p.dstDtypeBytes, p.dstSize, "dst");
    return true;
}

/* Copies are checked burst by burst by the intrinsics (UB and GM ranges,
 * alignment, burst limits). */
bool CheckFuncDataCopyImpl(DataCopyApiParams &, const char *) { return true; }
bool CheckFuncDataCopyPadImpl(DataCopyPadApiParams &, const char *) { return true; }
} // namespace check

/* The CPU-debug headers serialise their log output across forked cores with
 * this lock; here one core runs at a time, under the model's own lock. */
ProcessLock *ProcessLock::processLock = nullptr;
ProcessLock::ProcessLock() {}
ProcessLock::~ProcessLock() {}
ProcessLock *ProcessLock::CreateLock()
{
    static ProcessLock lock;
    return &lock;
}
int ProcessLock::Write() { return 0; }
int ProcessLock::Unlock() { return 0; }
} // namespace AscendC

namespace {

using KernelFn = void (*)(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                          GM_ADDR);

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

/* The GM buffers a launch with tiling `t` on `block_dim` cores may touch,
 * sized as the kernel's Init sizes its GlobalTensors. */
size_t LaunchRanges(const AmoeFinalizeTiling &t, uint32_t block_dim, void *const *gm, amoe_hm::GmRange *r)
{
    const uint64_t d = t.data_dtype == AMOE_DT_F32 ? 4u : 2u;
    const uint64_t s = t.scales_dtype == AMOE_DT_F32 ? 4u : 2u;
    const uint64_t h = t.h;
    const uint64_t nk = static_cast<uint64_t>(t.n) * t.k;
    const amoe_hm::GmRange all[] = {
        {gm[AMOE_FIN_GM_EXPANDED_X], static_cast<uint64_t>(t.expanded_rows) * h * d, "expanded_x"},
        {gm[AMOE_FIN_GM_ROW_IDX], nk * 4u, "expanded_row_idx"},
        {gm[AMOE_FIN_GM_X1], static_cast<uint64_t>(t.n) * h * d, "x1"},
        {gm[AMOE_FIN_GM_X2], static_cast<uint64_t>(t.n) * h * d, "x2"},
        {gm[AMOE_FIN_GM_BIAS], static_cast<uint64_t>(t.experts) * h * d, "bias"},
        {gm[AMOE_FIN_GM_SCALES], nk * s, "scales"},
        {gm[AMOE_FIN_GM_EXPERT_IDX], nk * 4u, "expert_idx"},
        {gm[AMOE_FIN_GM_OUT],
         (t.flags & AMOE_FIN_CHECK_INDICES) != 0
             ? ((t.flags & AMOE_FIN_HAS_BIAS) != 0 ? AMOE_FIN_CHECKED_EXPERT_OFFSET(nk) + nk : nk) * 4u
             : static_cast<uint64_t>(t.out_rows) * h * d,
         "out"},
        {gm[AMOE_FIN_GM_SLOT_OFFSETS], (static_cast<uint64_t>(t.slots) + 1u) * 4u, "slot_offsets"},
        {gm[AMOE_FIN_GM_STATUS], static_cast<uint64_t>(block_dim) * AMOE_FIN_STATUS_WORDS * 4u, "status"},
    };
    size_t n = 0;
    for (const amoe_hm::GmRange &g : all) {
        if (g.base != nullptr) {
            r[n++] = g;
        }
    }
    return n;
}

struct Launch {
    KernelFn kernel;
    void *const *gm;
    const void *tiling;
};

void RunFinalize(void *ctx)
{
    const Launch &l = *static_cast<const Launch *>(ctx);
    auto p = [&l](int i) { return static_cast<GM_ADDR>(l.gm[i]); };
    l.kernel(p(AMOE_FIN_GM_EXPANDED_X), p(AMOE_FIN_GM_ROW_IDX), p(AMOE_FIN_GM_X1), p(AMOE_FIN_GM_X2),
             p(AMOE_FIN_GM_BIAS), p(AMOE_FIN_GM_SCALES), p(AMOE_FIN_GM_EXPERT_IDX), p(AMOE_FIN_GM_OUT),
             p(AMOE_FIN_GM_SLOT_OFFSETS), p(AMOE_FIN_GM_STATUS), static_cast<GM_ADDR>(const_cast<void *>(l.tiling)));
}

void HostEntry(KernelFn kernel, uint32_t block_idx, uint32_t block_dim, void *const *gm, const void *tiling)
{
    if (gm == nullptr) {
        return;
    }
    void *status = gm[AMOE_FIN_GM_STATUS];
    if (block_idx >= block_dim || status == nullptr) {
        return; /* no record to write: the status array has block_dim records */
    }
    if (tiling == nullptr) {
        ReportViolation(status, block_idx, "launch: null tiling pointer");
        return;
    }
    AmoeFinalizeTiling t;
    std::memcpy(&t, tiling, sizeof(t));
    amoe_hm::GmRange ranges[AMOE_FIN_GM_COUNT];
    const size_t n = LaunchRanges(t, block_dim, gm, ranges);
    Launch l{kernel, gm, tiling};
    const std::string violation = amoe_hm::RunCore(block_idx, block_dim, ranges, n, RunFinalize, &l);
    if (!violation.empty()) {
        ReportViolation(status, block_idx, "block " + std::to_string(block_idx) + ": " + violation);
    }
}

} // namespace

extern "C" void amoe_finalize_kernel_host(uint32_t block_idx, uint32_t block_dim, void *const *gm,
                                          const void *tiling)
{
    HostEntry(amoe_finalize_kernel, block_idx, block_dim, gm, tiling);
}

namespace {

struct GuardLaunch {
    void *const *gm;
    const void *tiling;
};

void RunGuard(void *ctx)
{
    const GuardLaunch &l = *static_cast<const GuardLaunch *>(ctx);
    amoe_guard_kernel(static_cast<GM_ADDR>(l.gm[AMOE_GUARD_GM_LIVE]), static_cast<GM_ADDR>(l.gm[AMOE_GUARD_GM_STATUS]),
                      static_cast<GM_ADDR>(const_cast<void *>(l.tiling)));
}

} // namespace

/* Host entry of the forward-context guard (guard_kernel.cpp), with the
 * signature of cannsim_kernel_entry. */
extern "C" void amoe_guard_kernel_host(uint32_t block_idx, uint32_t block_dim, void *const *gm, const void *tiling)
{
    if (gm == nullptr) {
        return;
    }
    void *status = gm[AMOE_GUARD_GM_STATUS];
    if (block_idx >= block_dim || status == nullptr) {
        return;
    }
    if (tiling == nullptr) {
        ReportViolation(status, block_idx, "launch: null tiling pointer");
        return;
    }
    amoe_hm::GmRange ranges[AMOE_GUARD_GM_COUNT];
    size_t n = 0;
    if (gm[AMOE_GUARD_GM_LIVE] != nullptr) {
        ranges[n++] = {gm[AMOE_GUARD_GM_LIVE], AMOE_CTX_WORDS * 4u, "live_context"};
    }
    ranges[n++] = {status, static_cast<uint64_t>(block_dim) * AMOE_FIN_STATUS_WORDS * 4u, "status"};
    GuardLaunch l{gm, tiling};
    const std::string violation = amoe_hm::RunCore(block_idx, block_dim, ranges, n, RunGuard, &l);
    if (!violation.empty()) {
        ReportViolation(status, block_idx, "block " + std::to_string(block_idx) + ": " + violation);
    }
}

/* Byte offsets of AmoeGuardTiling's fields, then its sizeof. */
extern "C" size_t amoe_guard_tiling_layout(uint32_t *out, size_t cap)
{
    const uint32_t v[] = {
        offsetof(AmoeGuardTiling, magic),
        offsetof(AmoeGuardTiling, words),
        offsetof(AmoeGuardTiling, mask),
        offsetof(AmoeGuardTiling, expected),
        offsetof(AmoeGuardTiling, alt_word),
        offsetof(AmoeGuardTiling, alt_value),
        sizeof(AmoeGuardTiling),
    };
    const size_t n = sizeof(v) / sizeof(v[0]);
    for (size_t i = 0; i < n && i < cap && out != nullptr; ++i) {
        out[i] = v[i];
    }
    return n;
}

/* The same kernel built with AMOE_FINALIZE_DROP_BARRIER (one PipeBarrier of
 * the Muls -> Add step left out), to show the model rejects it. */
extern "C" void amoe_finalize_kernel_host_dropped_barrier(uint32_t block_idx, uint32_t block_dim, void *const *gm,
                                                          const void *tiling)
{
    HostEntry(amoe_finalize_kernel_dropped_barrier, block_idx, block_dim, gm, tiling);
}

namespace {

using namespace AscendC;

alignas(32) float g_selftestGm[64];

/* Orders everything issued on the event's source pipe before what the
 * destination pipe issues next. */
template <HardEvent E>
void Sync(TPipe &pipe)
{
    const event_t ev = static_cast<event_t>(pipe.FetchEventID(E));
    SetFlag<E>(ev);
    WaitFlag<E>(ev);
}

/* Small kernels that break one rule each (case 0 breaks none), to show the
 * model catches what the finalize kernel itself never does. */
void SelftestKernel(uint32_t which)
{
    GlobalTensor<float> gm;
    gm.SetGlobalBuffer(g_selftestGm, 64);
    TPipe pipe;
    TQue<QuePosition::VECIN, 1> que;
    TBuf<QuePosition::VECCALC> calc;
    pipe.InitBuffer(que, 1, 64 * sizeof(float));
    pipe.InitBuffer(calc, 64 * sizeof(float));
    LocalTensor<float> c = calc.Get<float>();
    LocalTensor<float> t = que.AllocTensor<float>();
    switch (which) {
    case 0: /* balanced, aligned and synchronised */
        DataCopy(t, gm, 64);
        que.EnQue(t);
        t = que.DeQue<float>();
        Add(c, t, t, 64);
        PipeBarrier<PIPE_V>();
        Muls(c, c, 2.0f, 64);
        que.FreeTensor(t);
        return;
    case 1: /* a second AllocTensor on a one-buffer queue */
        que.AllocTensor<float>();
        return;
    case 2: /* DeQue with nothing enqueued */
        que.FreeTensor(t);
        que.DeQue<float>();
        return;
    case 3: /* returns with the tensor still allocated */
        return;
    case 4: /* use after FreeTensor */
        que.FreeTensor(t);
        Duplicate(t, 1.0f, 8);
        return;
    case 5: /* vector op past the end of the tensor */
        que.FreeTensor(t);
        Add(c, c, c, 65);
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
    case 9: /* MTE2 result used by V with no SetFlag/WaitFlag (the queue would insert them) */
        que.FreeTensor(t);
        DataCopy(c, gm, 64);
        Muls(c, c, 2.0f, 64);
        return;
    case 10: /* dependent vector ops with no PipeBarrier<PIPE_V> */
        que.FreeTensor(t);
        Duplicate(c, 1.0f, 64);
        Muls(c, c, 2.0f, 64);
        return;
    case 11: /* a vector op overwrites what MTE3 is still copying out */
    case 12: /* the same, ordered by MTE3 -> V flags: clean */
        que.FreeTensor(t);
        Duplicate(c, 1.0f, 64);
        PipeBarrier<PIPE_V>(); /* orders the second Duplicate after the first */
        Sync<HardEvent::V_MTE3>(pipe);
        DataCopy(gm, c, 64);
        if (which == 12) {
            Sync<HardEvent::MTE3_V>(pipe);
        }
        Duplicate(c, 2.0f, 64);
        return;
    case 13: /* WaitFlag on an event nobody set: a hang on the hardware */
        que.FreeTensor(t);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID3);
        return;
    default:
        que.FreeTensor(t);
        amoe_hm::Fail("selftest: unknown case %u", which);
    }
}

void RunSelftest(void *ctx) { SelftestKernel(*static_cast<const uint32_t *>(ctx)); }

} // namespace

/* Runs self-test kernel `which` on one core; writes the violation message
 * (empty when none) into msg and returns 1 if the run was aborted. */
extern "C" int amoe_sim_selftest(uint32_t which, char *msg, size_t cap)
{
    const amoe_hm::GmRange gm{g_selftestGm, sizeof(g_selftestGm), "selftest gm"};
    const std::string v = amoe_hm::RunCore(0, 1, &gm, 1, RunSelftest, &which);
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

/* Unified-buffer capacity the model enforces per core. */
extern "C" uint32_t amoe_sim_ub_capacity(void) { return static_cast<uint32_t>(amoe_hm::kUbBytes); }
