/*
 * Fused MoE finalize routing, Ascend C (SPEC.md section 1; padded output of
 * section 3).
 *
 *   out[i,:] = x1[i,:] + x2[i,:] + sum_k s(i,k) * (row(R(i,k)) + bias[expert_idx[i,k], :])
 *
 * Accumulation is f32 in exactly the SPEC order: acc = x1 (+ x2); then for
 * k = 0..K-1: term = row (+ bias); term = s * term; acc = acc + term; one final
 * round-to-nearest-even cast to the output type. Separate Muls and Add (no
 * Axpy) keep the multiply and the add as two roundings on every target.
 *
 * Work split: the output rows (tokens, or every row of the padded EP buffer)
 * are spread over the cores, the first out_rows % block_dim cores taking one
 * more; a core with no rows only writes its status. Each row is processed in
 * tiles of tile_h elements along H so the buffers fit the unified buffer.
 *
 * Index checks: a row index outside [0, expanded_rows) (or -1 in the
 * drop-pad modes 1/3, a dropped slot) and an expert index outside
 * [0, experts) are never used to address memory: the slot contributes
 * nothing and the core records the first such position in its status record,
 * which the host turns into an error. With AMOE_FIN_SKIP_INVALID_ROWS (token
 * unpermute) a row index outside [0, expanded_rows) contributes nothing and
 * is not recorded.
 *
 * Synchronisation: the queues order the pipes (EnQue/DeQue/FreeTensor insert
 * the MTE2 -> V, V -> MTE3 and back flags), and every vector instruction
 * whose result the next vector instruction reads, or whose operand it
 * overwrites, is followed by PipeBarrier<PIPE_V>: the build has no
 * --cce-auto-sync to insert them, and the V pipe does not interlock UB
 * dependences between its own instructions.
 *
 * With AMOE_FIN_CHECK_INDICES the launch only checks the index tensors
 * (IndexCheck): the aclnn path runs it first and gives aclnn the checked
 * copies, so a bad index is reported at the stream check and never read.
 *
 * Built with AMOE_FINALIZE_DROP_BARRIER, the barrier between Muls and the
 * accumulating Add is left out (and the entry is renamed through
 * AMOE_FINALIZE_KERNEL_NAME): a test build that the host model must reject.
 */
#include "finalize_tiling.h"
#include "kernel_operator.h"

using namespace AscendC;

namespace {

__aicore__ inline float ScalarToF32(float v) { return v; }
__aicore__ inline float ScalarToF32(half v) { return static_cast<float>(v); }
__aicore__ inline float ScalarToF32(bfloat16_t v) { return ToFloat(v); }

__aicore__ inline uint32_t AlignUp(uint32_t v, uint32_t a) { return (v + a - 1u) / a * a; }

/* Orders a vector instruction after the previous one on the V pipe. */
__aicore__ inline void VecBarrier() { PipeBarrier<PIPE_V>(); }

__aicore__ inline void LoadTiling(AmoeFinalizeTiling &t, GM_ADDR tiling)
{
    __gm__ uint32_t *src = reinterpret_cast<__gm__ uint32_t *>(tiling);
    uint32_t *dst = reinterpret_cast<uint32_t *>(&t);
    for (uint32_t i = 0; i < sizeof(AmoeFinalizeTiling) / sizeof(uint32_t); ++i) {
        dst[i] = src[i];
    }
}

/* Writes this core's 32-byte status head from UB through MTE3, and a
 * problem also to the record's sticky copy (finalize_tiling.h). */
__aicore__ inline void StoreStatus(GM_ADDR status, const LocalTensor<uint32_t> &buf, const uint32_t head[8])
{
    __gm__ uint32_t *rec = reinterpret_cast<__gm__ uint32_t *>(status) + GetBlockIdx() * AMOE_FIN_STATUS_WORDS;
    GlobalTensor<uint32_t> gm;
    gm.SetGlobalBuffer(rec, AMOE_FIN_STATUS_HEAD_WORDS);
    const bool problem = head[AMOE_FIN_STATUS_CODE] != AMOE_FIN_ST_OK;
    for (uint32_t i = 0; i < AMOE_FIN_STATUS_HEAD_WORDS; ++i) {
        buf.SetValue(i, head[i]);
    }
    if (problem) {
        buf.SetValue(AMOE_FIN_STATUS_HEAD_WORDS - 1u, AMOE_FIN_STICKY_MARK);
    }
    event_t ev = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_MTE3));
    SetFlag<HardEvent::S_MTE3>(ev);
    WaitFlag<HardEvent::S_MTE3>(ev);
    DataCopy(gm, buf, AMOE_FIN_STATUS_HEAD_WORDS);
    if (problem) {
        GlobalTensor<uint32_t> sticky;
        sticky.SetGlobalBuffer(rec + AMOE_FIN_STICKY_WORD, AMOE_FIN_STATUS_HEAD_WORDS);
        DataCopy(sticky, buf, AMOE_FIN_STATUS_HEAD_WORDS);
    }
}

template <typename T, typename S>
class FinalizeRouting {
    static constexpr bool kF32 = IsSameType<T, float>::value;

public:
    __aicore__ inline FinalizeRouting() {}

    __aicore__ inline void Init(GM_ADDR expandedX, GM_ADDR rowIdx, GM_ADDR x1, GM_ADDR x2, GM_ADDR bias,
                                GM_ADDR scales, GM_ADDR expertIdx, GM_ADDR out, GM_ADDR slotOffsets,
                                const AmoeFinalizeTiling &t, TPipe *pipe)
    {
        t_ = t;
        hasX1_ = (t.flags & AMOE_FIN_HAS_X1) != 0;
        hasX2_ = (t.flags & AMOE_FIN_HAS_X2) != 0;
        hasBias_ = (t.flags & AMOE_FIN_HAS_BIAS) != 0;
        hasScales_ = (t.flags & AMOE_FIN_HAS_SCALES) != 0;
        padded_ = (t.flags & AMOE_FIN_PADDED_OUT) != 0;
        skipInvalidRows_ = (t.flags & AMOE_FIN_SKIP_INVALID_ROWS) != 0;
        dropPad_ = t.mode == 1u || t.mode == 3u;
        rowLayout_ = t.mode == 2u || t.mode == 3u;
        const uint64_t h = t.h;
        const uint64_t nk = static_cast<uint64_t>(t.n) * t.k;

        xGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(expandedX), static_cast<uint64_t>(t.expanded_rows) * h);
        idxGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(rowIdx), nk);
        if (hasX1_) {
            x1Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(x1), static_cast<uint64_t>(t.n) * h);
        }
        if (hasX2_) {
            x2Gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(x2), static_cast<uint64_t>(t.n) * h);
        }
        if (hasBias_) {
            biasGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(bias), static_cast<uint64_t>(t.experts) * h);
            expertGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(expertIdx), nk);
        }
        if (hasScales_) {
            scalesGm_.SetGlobalBuffer(reinterpret_cast<__gm__ S *>(scales), nk);
        }
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(out), static_cast<uint64_t>(t.out_rows) * h);
        if (padded_) {
            offsetsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(slotOffsets),
                                       static_cast<uint64_t>(t.slots) + 1u);
        }

        const uint32_t tileBytes = t.tile_h * static_cast<uint32_t>(sizeof(T));
        const uint32_t tileF32Bytes = t.tile_h * static_cast<uint32_t>(sizeof(float));
        pipe->InitBuffer(inQue_, 2, tileBytes);
        pipe->InitBuffer(biasQue_, 1, tileBytes);
        pipe->InitBuffer(outQue_, 1, tileBytes);
        pipe->InitBuffer(termBuf_, tileF32Bytes);
        if constexpr (!kF32) {
            pipe->InitBuffer(accBuf_, tileF32Bytes);
            pipe->InitBuffer(biasF32Buf_, tileF32Bytes);
        }
        pipe->InitBuffer(statusBuf_, AMOE_FIN_STATUS_HEAD_WORDS * sizeof(uint32_t));
        for (uint32_t i = 0; i < AMOE_FIN_STATUS_HEAD_WORDS; ++i) {
            status_[i] = 0;
        }
    }

    __aicore__ inline void Process(GM_ADDR status)
    {
        const uint32_t b = static_cast<uint32_t>(GetBlockIdx());
        const uint32_t rows = t_.rows_per_core + (b < t_.rows_rem ? 1u : 0u);
        const uint32_t first = b * t_.rows_per_core + (b < t_.rows_rem ? b : t_.rows_rem);
        for (uint32_t r = 0; r < rows; ++r) {
            ProcessRow(first + r);
        }
        StoreStatus(status, statusBuf_.Get<uint32_t>(), status_);
    }

private:
    __aicore__ inline void Flag(uint32_t code, uint64_t position, int32_t value)
    {
        if (status_[AMOE_FIN_STATUS_CODE] == AMOE_FIN_ST_OK) {
            status_[AMOE_FIN_STATUS_CODE] = code;
            status_[AMOE_FIN_STATUS_POSITION] = static_cast<uint32_t>(position);
            status_[AMOE_FIN_STATUS_VALUE] = static_cast<uint32_t>(value);
        }
    }

    /* The token written to output row `row`, or -1 for a padding row. */
    __aicore__ inline int64_t TokenOf(uint32_t row)
    {
        if (!padded_) {
            return row;
        }
        const uint32_t slot = row / t_.slot_rows;
        const uint32_t j = row % t_.slot_rows;
        const int32_t begin = offsetsGm_.GetValue(slot);
        const int32_t end = offsetsGm_.GetValue(slot + 1u);
        if (begin < 0 || end < begin || static_cast<uint32_t>(end) > t_.n ||
            static_cast<uint32_t>(end - begin) > t_.slot_rows) {
            Flag(AMOE_FIN_ST_SLOT_LAYOUT, slot, begin);
            return -1;
        }
        return j < static_cast<uint32_t>(end - begin) ? static_cast<int64_t>(begin) + j : -1;
    }

    __aicore__ inline void ProcessRow(uint32_t row)
    {
        const int64_t token = TokenOf(row);
        for (uint32_t tile = 0; tile < t_.tiles; ++tile) {
            const uint32_t len = (tile + 1u == t_.tiles) ? t_.tail_h : t_.tile_h;
            const uint64_t col = static_cast<uint64_t>(tile) * t_.tile_h;
            if (token < 0) {
                ZeroTile(static_cast<uint64_t>(row) * t_.h + col, len);
            } else {
                ComputeTile(static_cast<uint32_t>(token), static_cast<uint64_t>(row) * t_.h + col, col, len);
            }
        }
    }

    /* GM -> UB into a fresh queue buffer, enqueued; DataCopyPad for a tail tile. */
    template <typename Q, typename U>
    __aicore__ inline void Load(Q &que, const GlobalTensor<U> &gm, uint64_t offset, uint32_t len)
    {
        LocalTensor<U> l = que.template AllocTensor<U>();
        if (len == t_.tile_h) {
            DataCopy(l, gm[offset], len);
        } else {
            DataCopyExtParams p{1, static_cast<uint32_t>(len * sizeof(U)), 0, 0, 0};
            DataCopyPadExtParams<U> pad{false, 0, 0, U(0)};
            DataCopyPad(l, gm[offset], p, pad);
        }
        que.EnQue(l);
    }

    template <typename Q, typename U>
    __aicore__ inline LocalTensor<U> CopyIn(Q &que, const GlobalTensor<U> &gm, uint64_t offset, uint32_t len)
    {
        Load(que, gm, offset, len);
        return que.template DeQue<U>();
    }

    __aicore__ inline void CopyOut(uint64_t offset, LocalTensor<T> &l, uint32_t len)
    {
        outQue_.EnQue(l);
        LocalTensor<T> o = outQue_.template DeQue<T>();
        if (len == t_.tile_h) {
            DataCopy(outGm_[offset], o, len);
        } else {
            DataCopyExtParams p{1, static_cast<uint32_t>(len * sizeof(T)), 0, 0, 0};
            DataCopyPad(outGm_[offset], o, p);
        }
        outQue_.FreeTensor(o);
    }

    __aicore__ inline void ZeroTile(uint64_t outOffset, uint32_t len)
    {
        LocalTensor<T> o = outQue_.template AllocTensor<T>();
        if constexpr (kF32) {
            Duplicate(o, 0.0f, static_cast<int32_t>(len));
        } else {
            /* +0 has all bits clear in f16 and bf16 alike. */
            Duplicate(o.template ReinterpretCast<uint16_t>(), static_cast<uint16_t>(0), static_cast<int32_t>(len));
        }
        CopyOut(outOffset, o, len);
    }

    /* acc = f32(src) for the first skip input. */
    __aicore__ inline void SetAcc(const LocalTensor<float> &acc, const LocalTensor<T> &src, uint32_t len)
    {
        if constexpr (kF32) {
            DataCopy(acc, src, AlignUp(len, 8u)); /* UB -> UB: a PIPE_V copy */
        } else {
            Cast(acc, src, RoundMode::CAST_NONE, len);
        }
        VecBarrier();
    }

    /* The tile widened to f32: the buffer itself for f32, else a cast into `scratch`. */
    __aicore__ inline LocalTensor<float> Widen(const LocalTensor<T> &src, const LocalTensor<float> &scratch,
                                               uint32_t len)
    {
        if constexpr (kF32) {
            return src;
        } else {
            Cast(scratch, src, RoundMode::CAST_NONE, len);
            VecBarrier();
            return scratch;
        }
    }

    /* One (token, k) slot, resolved and bounds-checked. */
    struct Slot {
        bool use;     /* contributes (indices valid) */
        bool dropped; /* drop-pad -1: zero row, bias still added */
        int32_t row;
        int32_t expert;
        float scale;
    };

    __aicore__ inline Slot Resolve(uint32_t token, uint32_t k)
    {
        Slot s{false, false, 0, 0, 1.0f};
        const uint64_t pos =
            rowLayout_ ? static_cast<uint64_t>(token) * t_.k + k : static_cast<uint64_t>(k) * t_.n + token;
        const uint64_t nkPos = static_cast<uint64_t>(token) * t_.k + k;
        const int32_t r = idxGm_.GetValue(pos);
        s.dropped = dropPad_ && r == -1;
        if (!s.dropped && (r < 0 || static_cast<uint32_t>(r) >= t_.expanded_rows)) {
            if (!skipInvalidRows_) {
                Flag(AMOE_FIN_ST_ROW_INDEX, pos, r);
            }
            return s;
        }
        if (hasBias_) {
            const int32_t e = expertGm_.GetValue(nkPos);
            if (e < 0 || static_cast<uint32_t>(e) >= t_.experts) {
                Flag(AMOE_FIN_ST_EXPERT_INDEX, nkPos, e);
                return s;
            }
            s.expert = e;
        }
        if (hasScales_) {
            s.scale = ScalarToF32(scalesGm_.GetValue(nkPos));
        }
        s.row = r;
        s.use = true;
        return s;
    }

    /* Starts the copy of a slot's row tile; DeQue in Take waits for it. */
    __aicore__ inline void Issue(const Slot &s, uint64_t col, uint32_t len)
    {
        if (s.use && !s.dropped) {
            Load(inQue_, xGm_, static_cast<uint64_t>(s.row) * t_.h + col, len);
        }
    }

    __aicore__ inline void ComputeTile(uint32_t token, uint64_t outOffset, uint64_t col, uint32_t len)
    {
        const uint64_t h = t_.h;
        LocalTensor<T> o = outQue_.template AllocTensor<T>();
        LocalTensor<float> acc;
        if constexpr (kF32) {
            acc = o;
        } else {
            acc = accBuf_.Get<float>();
        }
        const LocalTensor<float> termScratch = termBuf_.Get<float>();

        if (hasX1_) {
            LocalTensor<T> a = CopyIn(inQue_, x1Gm_, token * h + col, len);
            SetAcc(acc, a, len);
            inQue_.FreeTensor(a);
        }
        if (hasX2_) {
            LocalTensor<T> b = CopyIn(inQue_, x2Gm_, token * h + col, len);
            if (hasX1_) {
                Add(acc, acc, Widen(b, termScratch, len), static_cast<int32_t>(len));
                VecBarrier();
            } else {
                SetAcc(acc, b, len);
            }
            inQue_.FreeTensor(b);
        }
        if (!hasX1_ && !hasX2_) {
            Duplicate(acc, 0.0f, static_cast<int32_t>(len));
            VecBarrier();
        }

        /* Double buffering: the row of slot k+1 is in flight while slot k
         * is computed (the input queue has two buffers). */
        Slot cur = Slot{false, false, 0, 0, 1.0f};
        if (t_.k > 0) {
            cur = Resolve(token, 0);
            Issue(cur, col, len);
        }
        for (uint32_t k = 0; k < t_.k; ++k) {
            Slot next = Slot{false, false, 0, 0, 1.0f};
            if (k + 1u < t_.k) {
                next = Resolve(token, k + 1u);
                Issue(next, col, len);
            }
            if (cur.use) {
                LocalTensor<T> rowT;
                LocalTensor<float> term;
                if (cur.dropped) {
                    term = termScratch;
                    Duplicate(term, 0.0f, static_cast<int32_t>(len));
                    VecBarrier();
                } else {
                    rowT = inQue_.template DeQue<T>();
                    term = Widen(rowT, termScratch, len);
                }
                if (hasBias_) {
                    LocalTensor<T> bt = CopyIn(biasQue_, biasGm_, static_cast<uint64_t>(cur.expert) * h + col, len);
                    if constexpr (kF32) {
                        Add(term, term, bt, static_cast<int32_t>(len));
                    } else {
                        Add(term, term, Widen(bt, biasF32Buf_.Get<float>(), len), static_cast<int32_t>(len));
                    }
                    VecBarrier();
                    biasQue_.FreeTensor(bt);
                }
                if (hasScales_) {
                    Muls(term, term, cur.scale, static_cast<int32_t>(len));
#ifndef AMOE_FINALIZE_DROP_BARRIER
                    VecBarrier();
#endif
                }
                /* Also orders the next slot's writes of termBuf_ and acc. */
                Add(acc, acc, term, static_cast<int32_t>(len));
                VecBarrier();
                if (!cur.dropped) {
                    inQue_.FreeTensor(rowT);
                }
            }
            cur = next;
        }

        if constexpr (!kF32) {
            Cast(o, acc, RoundMode::CAST_RINT, len);
            VecBarrier(); /* the next tile overwrites acc */
        }
        CopyOut(outOffset, o, len);
    }

    AmoeFinalizeTiling t_;
    bool hasX1_ = false, hasX2_ = false, hasBias_ = false, hasScales_ = false;
    bool padded_ = false, dropPad_ = false, rowLayout_ = false, skipInvalidRows_ = false;
    uint32_t status_[AMOE_FIN_STATUS_HEAD_WORDS];

    GlobalTensor<T> xGm_, x1Gm_, x2Gm_, biasGm_, outGm_;
    GlobalTensor<S> scalesGm_;
    GlobalTensor<int32_t> idxGm_, expertGm_, offsetsGm_;

    TQue<QuePosition::VECIN, 2> inQue_;
    TQue<QuePosition::VECIN, 1> biasQue_;
    TQue<QuePosition::VECOUT, 1> outQue_;
    TBuf<QuePosition::VECCALC> termBuf_, accBuf_, biasF32Buf_, statusBuf_;
};

/* AMOE_FIN_CHECK_INDICES: copies each index tensor to `out` in chunks through
 * UB, replacing (and recording the first of) the values outside their range. */
class IndexCheck {
public:
    __aicore__ inline IndexCheck() {}

    __aicore__ inline void Run(GM_ADDR rowIdx, GM_ADDR expertIdx, GM_ADDR out, GM_ADDR status,
                               const AmoeFinalizeTiling &t)
    {
        TPipe pipe;
        pipe.InitBuffer(chunkBuf_, AMOE_FIN_CHECK_CHUNK * sizeof(int32_t));
        pipe.InitBuffer(statusBuf_, AMOE_FIN_STATUS_HEAD_WORDS * sizeof(uint32_t));
        for (uint32_t i = 0; i < AMOE_FIN_STATUS_HEAD_WORDS; ++i) {
            status_[i] = 0;
        }
        const uint64_t nk = static_cast<uint64_t>(t.n) * t.k;
        const uint32_t b = static_cast<uint32_t>(GetBlockIdx());
        const uint64_t per = nk / t.block_dim;
        const uint64_t rem = nk % t.block_dim;
        const uint64_t first = b * per + (b < rem ? b : rem);
        const uint64_t count = per + (b < rem ? 1u : 0u);
        const bool dropPad = t.mode == 1u || t.mode == 3u;
        const bool hasBias = (t.flags & AMOE_FIN_HAS_BIAS) != 0;
        const uint64_t expertAt = AMOE_FIN_CHECKED_EXPERT_OFFSET(nk);
        GlobalTensor<int32_t> rowGm, expertGm, outGm;
        rowGm.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(rowIdx), nk);
        outGm.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(out), hasBias ? expertAt + nk : nk);
        const int32_t rowLo = dropPad ? -1 : 0;
        Check(rowGm, outGm, 0, first, count, rowLo, static_cast<int64_t>(t.expanded_rows), rowLo,
              AMOE_FIN_ST_ROW_INDEX);
        if (hasBias) {
            expertGm.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(expertIdx), nk);
            Check(expertGm, outGm, expertAt, first, count, 0, static_cast<int64_t>(t.experts), 0,
                  AMOE_FIN_ST_EXPERT_INDEX);
        }
        StoreStatus(status, statusBuf_.Get<uint32_t>(), status_);
    }

private:
    /* Values of src[first, first + count) outside [lo, hi) become `safe` in
     * out[outAt + first, ...); the first one is recorded with `code`. */
    __aicore__ inline void Check(const GlobalTensor<int32_t> &src, const GlobalTensor<int32_t> &outGm, uint64_t outAt,
                                 uint64_t first, uint64_t count, int32_t lo, int64_t hi, int32_t safe, uint32_t code)
    {
        LocalTensor<int32_t> l = chunkBuf_.Get<int32_t>();
        for (uint64_t done = 0; done < count; done += AMOE_FIN_CHECK_CHUNK) {
            const uint32_t len = static_cast<uint32_t>(
                count - done < AMOE_FIN_CHECK_CHUNK ? count - done : static_cast<uint64_t>(AMOE_FIN_CHECK_CHUNK));
            DataCopyExtParams p{1, static_cast<uint32_t>(len * sizeof(int32_t)), 0, 0, 0};
            DataCopyPadExtParams<int32_t> pad{false, 0, 0, 0};
            DataCopyPad(l, src[first + done], p, pad);
            event_t in = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::MTE2_S));
            SetFlag<HardEvent::MTE2_S>(in);
            WaitFlag<HardEvent::MTE2_S>(in);
            for (uint32_t i = 0; i < len; ++i) {
                const int32_t v = l.GetValue(i);
                if (v < lo || static_cast<int64_t>(v) >= hi) {
                    if (status_[AMOE_FIN_STATUS_CODE] == AMOE_FIN_ST_OK) {
                        status_[AMOE_FIN_STATUS_CODE] = code;
                        status_[AMOE_FIN_STATUS_POSITION] = static_cast<uint32_t>(first + done + i);
                        status_[AMOE_FIN_STATUS_VALUE] = static_cast<uint32_t>(v);
                    }
                    l.SetValue(i, safe);
                }
            }
            event_t toOut = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_MTE3));
            SetFlag<HardEvent::S_MTE3>(toOut);
            WaitFlag<HardEvent::S_MTE3>(toOut);
            DataCopyPad(outGm[outAt + first + done], l, p);
            /* The next chunk (or the status) overwrites UB only after MTE3 read it. */
            event_t back = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::MTE3_MTE2));
            SetFlag<HardEvent::MTE3_MTE2>(back);
            WaitFlag<HardEvent::MTE3_MTE2>(back);
            event_t scalar = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::MTE3_S));
            SetFlag<HardEvent::MTE3_S>(scalar);
            WaitFlag<HardEvent::MTE3_S>(scalar);
        }
    }

    TBuf<QuePosition::VECCALC> chunkBuf_, statusBuf_;
    uint32_t status_[AMOE_FIN_STATUS_HEAD_WORDS];
};

__aicore__ inline bool IsDataDtype(uint32_t d) { return d == AMOE_DT_F32 || d == AMOE_DT_F16 || d == AMOE_DT_BF16; }

/* Checks what the kernel cannot survive; sizes are the host's job. */
__aicore__ inline bool TilingOk(const AmoeFinalizeTiling &t)
{
    if (t.magic != AMOE_FINALIZE_TILING_MAGIC || !IsDataDtype(t.data_dtype) || t.mode > 3u) {
        return false;
    }
    if (t.scales_dtype != t.data_dtype && t.scales_dtype != AMOE_DT_F32) {
        return false;
    }
    if (t.block_dim != static_cast<uint32_t>(GetBlockNum()) || t.tile_h == 0u) {
        return false;
    }
    if ((t.flags & AMOE_FIN_PADDED_OUT) != 0 && t.slot_rows == 0u && t.out_rows != 0u) {
        return false;
    }
    if (t.h != 0u && (t.tiles == 0u || t.tail_h == 0u || t.tail_h > t.tile_h)) {
        return false;
    }
    return true;
}

template <typename T, typename S>
__aicore__ inline void Run(GM_ADDR expandedX, GM_ADDR rowIdx, GM_ADDR x1, GM_ADDR x2, GM_ADDR bias, GM_ADDR scales,
                           GM_ADDR expertIdx, GM_ADDR out, GM_ADDR slotOffsets, GM_ADDR status,
                           const AmoeFinalizeTiling &t)
{
    TPipe pipe;
    FinalizeRouting<T, S> op;
    op.Init(expandedX, rowIdx, x1, x2, bias, scales, expertIdx, out, slotOffsets, t, &pipe);
    op.Process(status);
}

} // namespace

#ifndef AMOE_FINALIZE_KERNEL_NAME
#define AMOE_FINALIZE_KERNEL_NAME amoe_finalize_kernel
#endif

extern "C" __global__ __aicore__ void AMOE_FINALIZE_KERNEL_NAME(GM_ADDR expandedX, GM_ADDR rowIdx, GM_ADDR x1,
                                                               GM_ADDR x2, GM_ADDR bias, GM_ADDR scales,
                                                               GM_ADDR expertIdx, GM_ADDR out, GM_ADDR slotOffsets,
                                                               GM_ADDR status, GM_ADDR tiling)
{
    /* Vector cores only: no cube core, so GetBlockNum() is the launch's
     * blockDim and no KFC client reserves the end of UB. */
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    AmoeFinalizeTiling t;
    LoadTiling(t, tiling);
    if (!TilingOk(t)) {
        TPipe pipe;
        TBuf<QuePosition::VECCALC> buf;
        pipe.InitBuffer(buf, AMOE_FIN_STATUS_HEAD_WORDS * sizeof(uint32_t));
        uint32_t head[AMOE_FIN_STATUS_HEAD_WORDS] = {AMOE_FIN_ST_BAD_TILING, 0, 0, 0, 0, 0, 0, 0};
        StoreStatus(status, buf.Get<uint32_t>(), head);
        return;
    }
    if ((t.flags & AMOE_FIN_CHECK_INDICES) != 0) {
        IndexCheck check;
        check.Run(rowIdx, expertIdx, out, status, t);
        return;
    }
    const bool f32Scales = t.scales_dtype == AMOE_DT_F32;
    if (t.data_dtype == AMOE_DT_F32) {
        Run<float, float>(expandedX, rowIdx, x1, x2, bias, scales, expertIdx, out, slotOffsets, status, t);
    } else if (t.data_dtype == AMOE_DT_F16) {
        if (f32Scales) {
            Run<half, float>(expandedX, rowIdx, x1, x2, bias, scales, expertIdx, out, slotOffsets, status, t);
        } else {
            Run<half, half>(expandedX, rowIdx, x1, x2, bias, scales, expertIdx, out, slotOffsets, status, t);
        }
    } else {
        if (f32Scales) {
            Run<bfloat16_t, float>(expandedX, rowIdx, x1, x2, bias, scales, expertIdx, out, slotOffsets, status, t);
        } else {
            Run<bfloat16_t, bfloat16_t>(expandedX, rowIdx, x1, x2, bias, scales, expertIdx, out, slotOffsets, status,
                                        t);
        }
    }
}
