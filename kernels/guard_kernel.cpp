/*
 * Forward-context guard, Ascend C (layout in guard_tiling.h).
 *
 * A graph captured for one forward context (comm type, DP token counts, ...)
 * computes that context's layout and reductions on every replay. The engine
 * rewrites the live context buffer before each replay; this kernel, captured
 * with the ops, compares the live words with the ones the ops were captured
 * for and records the first difference in its status record, which the host
 * reads at the caller's sync point. It never changes the ops' results: the
 * record is what makes a stale graph impossible to miss.
 *
 * One core. The live context moves GM -> UB in one DataCopy (256 bytes);
 * the scalar unit reads it after an MTE2 -> S flag, and the 32-byte status
 * head goes back through MTE3 after an S -> MTE3 flag. A mismatch also goes
 * to the record's sticky copy (guard_tiling.h), which a replay does not
 * reset.
 */
#include "finalize_tiling.h"
#include "guard_tiling.h"
#include "kernel_operator.h"

using namespace AscendC;

extern "C" __global__ __aicore__ void amoe_guard_kernel(GM_ADDR live, GM_ADDR status, GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    AmoeGuardTiling t;
    {
        __gm__ uint32_t *src = reinterpret_cast<__gm__ uint32_t *>(tiling);
        uint32_t *dst = reinterpret_cast<uint32_t *>(&t);
        for (uint32_t i = 0; i < sizeof(AmoeGuardTiling) / sizeof(uint32_t); ++i) {
            dst[i] = src[i];
        }
    }
    TPipe pipe;
    TBuf<QuePosition::VECCALC> liveBuf;
    TBuf<QuePosition::VECCALC> statusBuf;
    pipe.InitBuffer(liveBuf, AMOE_CTX_WORDS * sizeof(uint32_t));
    pipe.InitBuffer(statusBuf, AMOE_FIN_STATUS_HEAD_WORDS * sizeof(uint32_t));
    uint32_t head[AMOE_FIN_STATUS_HEAD_WORDS] = {AMOE_FIN_ST_OK, 0, 0, 0, 0, 0, 0, 0};

    if (t.magic != AMOE_GUARD_TILING_MAGIC || t.words > AMOE_CTX_WORDS || GetBlockIdx() != 0) {
        head[AMOE_FIN_STATUS_CODE] = AMOE_FIN_ST_BAD_TILING;
    } else {
        GlobalTensor<uint32_t> liveGm;
        liveGm.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t *>(live), AMOE_CTX_WORDS);
        LocalTensor<uint32_t> l = liveBuf.Get<uint32_t>();
        DataCopy(l, liveGm, AMOE_CTX_WORDS);
        event_t in = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::MTE2_S));
        SetFlag<HardEvent::MTE2_S>(in);
        WaitFlag<HardEvent::MTE2_S>(in);
        for (uint32_t i = 0; i < t.words; ++i) {
            if ((t.mask[i / 32u] >> (i % 32u) & 1u) == 0) {
                continue;
            }
            const uint32_t v = l.GetValue(i);
            if (v != t.expected[i] && !(i == t.alt_word && v == t.alt_value)) {
                head[AMOE_FIN_STATUS_CODE] = AMOE_GUARD_ST_MISMATCH;
                head[AMOE_FIN_STATUS_POSITION] = i;
                head[AMOE_FIN_STATUS_VALUE] = v;
                head[AMOE_GUARD_STATUS_EXPECTED] = t.expected[i];
                head[AMOE_FIN_STATUS_HEAD_WORDS - 1u] = AMOE_GUARD_STICKY_MARK;
                break;
            }
        }
    }

    GlobalTensor<uint32_t> statusGm;
    statusGm.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t *>(status), AMOE_FIN_STATUS_HEAD_WORDS);
    LocalTensor<uint32_t> s = statusBuf.Get<uint32_t>();
    for (uint32_t i = 0; i < AMOE_FIN_STATUS_HEAD_WORDS; ++i) {
        s.SetValue(i, head[i]);
    }
    event_t out = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_MTE3));
    SetFlag<HardEvent::S_MTE3>(out);
    WaitFlag<HardEvent::S_MTE3>(out);
    DataCopy(statusGm, s, AMOE_FIN_STATUS_HEAD_WORDS);
    if (head[AMOE_FIN_STATUS_CODE] == AMOE_GUARD_ST_MISMATCH) {
        GlobalTensor<uint32_t> stickyGm;
        stickyGm.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t *>(status) + AMOE_GUARD_STICKY_WORD,
                                 AMOE_FIN_STATUS_HEAD_WORDS);
        DataCopy(stickyGm, s, AMOE_FIN_STATUS_HEAD_WORDS);
    }
}
