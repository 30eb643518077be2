/*
 * Host implementation of the Ascend C API subset the kernels in kernels/ use.
 *
 * The same kernel source compiles against the real <kernel_operator.h> for the
 * NPU and against this header for the host. This header does not try to be
 * fast; it tries to fail where the hardware would misbehave:
 *
 *  - unified buffer (UB): every TPipe owns AMOE_SIM_UB_BYTES of UB; buffer
 *    allocations beyond it abort the run;
 *  - DataCopy: the byte length and the UB address must be multiples of 32;
 *    GM addresses must be element aligned; DataCopyPad is the only way to move
 *    a length that is not a multiple of 32 bytes;
 *  - queues: AllocTensor / EnQue / DeQue / FreeTensor must balance, a tensor
 *    must not be used after FreeTensor, and everything must be freed when the
 *    kernel returns;
 *  - bounds: every vector op and copy stays inside its LocalTensor and inside
 *    the size given to GlobalTensor::SetGlobalBuffer;
 *  - casts: only the conversions (and rounding modes) the kernel relies on.
 *
 * A violation throws amoe_sim::Violation; the host entry catches it and
 * reports it in the kernel's global-memory status record, so the host sees it
 * the same way it sees an error flag raised by the kernel itself.
 *
 * Not modelled: the pipes' concurrency (MTE2 / V / MTE3 / S run in program
 * order here, so SetFlag / WaitFlag are no-ops and a missing synchronisation
 * goes unnoticed), timing, the data cache of scalar GM accesses, L1 / cube
 * units, and any API the kernels do not use.
 */
#ifndef AMOE_SIM_KERNEL_OPERATOR_H
#define AMOE_SIM_KERNEL_OPERATOR_H

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t *

#ifndef AMOE_SIM_UB_BYTES
#define AMOE_SIM_UB_BYTES (192u * 1024u)
#endif

namespace amoe_sim {

/* A rule the hardware enforces (or would silently break) was violated. */
class Violation : public std::runtime_error {
public:
    explicit Violation(const std::string &msg) : std::runtime_error(msg) {}
};

[[noreturn]] inline void Fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] inline void Fail(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    throw Violation(buf);
}

class PipeState;

/* Per-thread state of the core being simulated. */
struct CoreContext {
    uint32_t blockIdx = 0;
    uint32_t blockNum = 0;
    bool active = false;
    PipeState *pipe = nullptr;
    std::string deferred; /* violation found where throwing is not allowed */
};

inline CoreContext &Ctx()
{
    static thread_local CoreContext ctx;
    return ctx;
}

inline void Defer(const std::string &msg)
{
    if (Ctx().deferred.empty()) {
        Ctx().deferred = msg;
    }
}

/* Bookkeeping of one queue or TBuf buffer inside the UB. */
struct BufSlot {
    uint32_t offset = 0; /* byte offset in the UB */
    uint32_t bytes = 0;
    bool allocated = false;
    bool queued = false;
    uint32_t generation = 0;
};

class PipeState {
public:
    PipeState()
    {
        ub_ = static_cast<uint8_t *>(::operator new(AMOE_SIM_UB_BYTES, std::align_val_t(64)));
        /* Garbage, not zeros: a kernel reading UB it never wrote sees NaNs. */
        std::memset(ub_, 0xA5, AMOE_SIM_UB_BYTES);
    }
    ~PipeState() { ::operator delete(ub_, std::align_val_t(64)); }
    PipeState(const PipeState &) = delete;
    PipeState &operator=(const PipeState &) = delete;

    uint32_t Reserve(uint32_t bytes, const char *what)
    {
        uint32_t rounded = (bytes + 31u) / 32u * 32u;
        if (bytes == 0) {
            Fail("TPipe::InitBuffer(%s): zero-byte buffer", what);
        }
        if (static_cast<uint64_t>(used_) + rounded > AMOE_SIM_UB_BYTES) {
            Fail("TPipe::InitBuffer(%s): %u bytes requested with %u of %u UB bytes in use: unified buffer overflow",
                 what, rounded, used_, AMOE_SIM_UB_BYTES);
        }
        uint32_t off = used_;
        used_ += rounded;
        return off;
    }
    uint8_t *Base() const { return ub_; }
    uint32_t Used() const { return used_; }

    /* Slots are owned here so LocalTensors can check them after FreeTensor. */
    BufSlot *NewSlot(uint32_t offset, uint32_t bytes)
    {
        slots_.push_back(new BufSlot());
        BufSlot *s = slots_.back();
        s->offset = offset;
        s->bytes = bytes;
        return s;
    }
    std::vector<BufSlot *> &Slots() { return slots_; }
    void ReleaseSlots()
    {
        for (BufSlot *s : slots_) {
            delete s;
        }
        slots_.clear();
    }

private:
    uint8_t *ub_ = nullptr;
    uint32_t used_ = 0;
    std::vector<BufSlot *> slots_;
};

inline uint32_t UbOffset(const void *p)
{
    return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(Ctx().pipe->Base()));
}

/* f32 -> binary16, round to nearest, ties to even; overflow -> inf. */
inline uint16_t F32ToF16Rne(float f)
{
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) { /* inf or NaN */
        if (ax == 0x7F800000u) {
            return static_cast<uint16_t>(sign | 0x7C00u);
        }
        return static_cast<uint16_t>(sign | 0x7C00u | 0x0200u | ((ax & 0x007FFFFFu) >> 13));
    }
    int32_t exp = static_cast<int32_t>(ax >> 23) - 127 + 15;
    uint32_t mant = ax & 0x007FFFFFu;
    if (exp >= 31) {
        return static_cast<uint16_t>(sign | 0x7C00u);
    }
    if (exp <= 0) { /* subnormal or zero result */
        if (exp < -10) {
            return static_cast<uint16_t>(sign);
        }
        mant |= 0x00800000u;
        uint32_t shift = static_cast<uint32_t>(14 - exp); /* 14..24 */
        uint32_t q = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) {
            q += 1u;
        }
        return static_cast<uint16_t>(sign | q);
    }
    uint32_t q = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) {
        q += 1u; /* may carry into the exponent, up to inf: correct */
    }
    return static_cast<uint16_t>(sign | q);
}

inline float F16ToF32(uint16_t h)
{
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        int e = -1;
        do {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400u) == 0);
        bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

/* f32 -> bfloat16, round to nearest, ties to even; NaN stays a quiet NaN. */
inline uint16_t F32ToBf16Rne(float f)
{
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return static_cast<uint16_t>((x >> 16) | 0x0040u);
    }
    uint32_t q = x >> 16;
    uint32_t rem = x & 0xFFFFu;
    if (rem > 0x8000u || (rem == 0x8000u && (q & 1u))) {
        q += 1u;
    }
    return static_cast<uint16_t>(q);
}

inline float Bf16ToF32(uint16_t b)
{
    uint32_t bits = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

} // namespace amoe_sim

/* The device's 16-bit float types: storage only, conversions are explicit. */
struct half {
    uint16_t bits;
    half() = default;
    half(float f) : bits(amoe_sim::F32ToF16Rne(f)) {}
    half(int v) : bits(amoe_sim::F32ToF16Rne(static_cast<float>(v))) {}
    explicit operator float() const { return amoe_sim::F16ToF32(bits); }
};

struct bfloat16_t {
    uint16_t bits;
    bfloat16_t() = default;
    bfloat16_t(float f) : bits(amoe_sim::F32ToBf16Rne(f)) {}
    bfloat16_t(int v) : bits(amoe_sim::F32ToBf16Rne(static_cast<float>(v))) {}
    explicit operator float() const { return amoe_sim::Bf16ToF32(bits); }
};

typedef int32_t event_t;

namespace AscendC {

enum class TPosition : uint8_t { GM, VECIN, VECOUT, VECCALC };
using QuePosition = TPosition;

enum class RoundMode : uint8_t { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };

enum class HardEvent : uint8_t { MTE2_V, V_MTE2, V_MTE3, MTE3_V, S_MTE3, MTE3_S, MTE2_S, S_MTE2, V_S, S_V };

enum pipe_t { PIPE_S, PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };

template <typename T, typename U>
struct IsSameType {
    static constexpr bool value = false;
};
template <typename T>
struct IsSameType<T, T> {
    static constexpr bool value = true;
};

inline int64_t GetBlockIdx()
{
    if (!amoe_sim::Ctx().active) {
        amoe_sim::Fail("GetBlockIdx outside a kernel launch");
    }
    return amoe_sim::Ctx().blockIdx;
}
inline int64_t GetBlockNum()
{
    if (!amoe_sim::Ctx().active) {
        amoe_sim::Fail("GetBlockNum outside a kernel launch");
    }
    return amoe_sim::Ctx().blockNum;
}

inline float ToFloat(const bfloat16_t &v) { return static_cast<float>(v); }

template <HardEvent E>
inline void SetFlag(event_t) {}
template <HardEvent E>
inline void WaitFlag(event_t) {}
template <pipe_t P>
inline void PipeBarrier() {}

template <typename T>
class GlobalTensor {
public:
    void SetGlobalBuffer(__gm__ T *buffer, uint64_t size)
    {
        if (buffer == nullptr && size != 0) {
            amoe_sim::Fail("GlobalTensor::SetGlobalBuffer: null buffer of %llu elements",
                           static_cast<unsigned long long>(size));
        }
        if (reinterpret_cast<uintptr_t>(buffer) % alignof(T) != 0) {
            amoe_sim::Fail("GlobalTensor::SetGlobalBuffer: address %p not aligned to its element", buffer);
        }
        base_ = buffer;
        size_ = size;
    }
    GlobalTensor operator[](uint64_t offset) const
    {
        if (offset > size_) {
            amoe_sim::Fail("GlobalTensor[%llu]: beyond the %llu-element buffer", static_cast<unsigned long long>(offset),
                           static_cast<unsigned long long>(size_));
        }
        GlobalTensor g;
        g.base_ = base_ + offset;
        g.size_ = size_ - offset;
        return g;
    }
    T GetValue(uint64_t i) const
    {
        Check(i, 1, "GetValue");
        return base_[i];
    }
    void SetValue(uint64_t i, T v)
    {
        Check(i, 1, "SetValue");
        base_[i] = v;
    }
    __gm__ T *GetPhyAddr() const { return base_; }
    uint64_t GetSize() const { return size_; }
    void Check(uint64_t i, uint64_t n, const char *op) const
    {
        if (base_ == nullptr || i > size_ || n > size_ - i) {
            amoe_sim::Fail("GlobalTensor::%s: elements [%llu, %llu) outside the %llu-element buffer", op,
                           static_cast<unsigned long long>(i), static_cast<unsigned long long>(i + n),
                           static_cast<unsigned long long>(size_));
        }
    }

private:
    T *base_ = nullptr;
    uint64_t size_ = 0;
};

template <typename T>
class LocalTensor {
public:
    LocalTensor() = default;
    LocalTensor(T *p, uint32_t size, amoe_sim::BufSlot *slot)
        : ptr_(p), size_(size), slot_(slot), gen_(slot ? slot->generation : 0)
    {
    }

    LocalTensor operator[](uint32_t offset) const
    {
        Check(offset, 0, "operator[]");
        return LocalTensor(ptr_ + offset, size_ - offset, slot_, gen_);
    }
    T GetValue(uint32_t i) const
    {
        Check(i, 1, "GetValue");
        return ptr_[i];
    }
    void SetValue(uint32_t i, T v) const
    {
        Check(i, 1, "SetValue");
        ptr_[i] = v;
    }
    uint32_t GetSize() const { return size_; }
    template <typename U>
    LocalTensor<U> ReinterpretCast() const
    {
        Check(0, 0, "ReinterpretCast");
        return LocalTensor<U>(reinterpret_cast<U *>(ptr_), static_cast<uint32_t>(size_ * sizeof(T) / sizeof(U)),
                              slot_, gen_);
    }

    /* Validates [i, i + n) and returns the host address of element i. */
    T *Span(uint32_t i, uint64_t n, const char *op) const
    {
        Check(i, n, op);
        return ptr_ + i;
    }
    T *Raw() const { return ptr_; }
    amoe_sim::BufSlot *Slot() const { return slot_; }
    uint32_t Generation() const { return gen_; }

    LocalTensor(T *p, uint32_t size, amoe_sim::BufSlot *slot, uint32_t gen)
        : ptr_(p), size_(size), slot_(slot), gen_(gen)
    {
    }

private:
    void Check(uint64_t i, uint64_t n, const char *op) const
    {
        if (ptr_ == nullptr) {
            amoe_sim::Fail("LocalTensor::%s on a tensor that was never allocated", op);
        }
        if (slot_ != nullptr && (!slot_->allocated || slot_->generation != gen_)) {
            amoe_sim::Fail("LocalTensor::%s on a tensor used after FreeTensor", op);
        }
        if (i > size_ || n > size_ - i) {
            amoe_sim::Fail("LocalTensor::%s: elements [%llu, %llu) outside the %u-element tensor", op,
                           static_cast<unsigned long long>(i), static_cast<unsigned long long>(i + n), size_);
        }
    }

    T *ptr_ = nullptr;
    uint32_t size_ = 0;
    amoe_sim::BufSlot *slot_ = nullptr;
    uint32_t gen_ = 0;
};

class TPipe;

inline TPipe *&CurrentPipe()
{
    static thread_local TPipe *pipe = nullptr;
    return pipe;
}

template <TPosition POS, int32_t DEPTH>
class TQue {
public:
    template <typename T>
    LocalTensor<T> AllocTensor()
    {
        Ready("AllocTensor");
        for (amoe_sim::BufSlot *s : slots_) {
            if (!s->allocated) {
                s->allocated = true;
                s->queued = false;
                s->generation += 1;
                return LocalTensor<T>(reinterpret_cast<T *>(base_ + s->offset), s->bytes / sizeof(T), s);
            }
        }
        amoe_sim::Fail("TQue::AllocTensor: all %zu buffers of the queue are allocated (missing FreeTensor)",
                       slots_.size());
    }
    template <typename T>
    bool EnQue(const LocalTensor<T> &t)
    {
        Ready("EnQue");
        amoe_sim::BufSlot *s = Owned(t, "EnQue");
        if (s->queued) {
            amoe_sim::Fail("TQue::EnQue: tensor is already enqueued");
        }
        if (fifo_.size() >= static_cast<size_t>(DEPTH)) {
            amoe_sim::Fail("TQue::EnQue: queue depth %d exceeded", DEPTH);
        }
        s->queued = true;
        fifo_.push_back(s);
        return true;
    }
    template <typename T>
    LocalTensor<T> DeQue()
    {
        Ready("DeQue");
        if (fifo_.empty()) {
            amoe_sim::Fail("TQue::DeQue: queue is empty (missing EnQue)");
        }
        amoe_sim::BufSlot *s = fifo_.front();
        fifo_.erase(fifo_.begin());
        s->queued = false;
        return LocalTensor<T>(reinterpret_cast<T *>(base_ + s->offset), s->bytes / sizeof(T), s);
    }
    template <typename T>
    void FreeTensor(const LocalTensor<T> &t)
    {
        Ready("FreeTensor");
        amoe_sim::BufSlot *s = Owned(t, "FreeTensor");
        if (s->queued) {
            amoe_sim::Fail("TQue::FreeTensor: tensor is still enqueued (missing DeQue)");
        }
        s->allocated = false;
    }

private:
    friend class TPipe;
    void Ready(const char *op) const
    {
        if (slots_.empty()) {
            amoe_sim::Fail("TQue::%s before TPipe::InitBuffer", op);
        }
    }
    template <typename T>
    amoe_sim::BufSlot *Owned(const LocalTensor<T> &t, const char *op) const
    {
        for (amoe_sim::BufSlot *s : slots_) {
            if (s == t.Slot()) {
                if (!s->allocated || s->generation != t.Generation()) {
                    amoe_sim::Fail("TQue::%s: tensor was already freed", op);
                }
                if (reinterpret_cast<uint8_t *>(t.Raw()) != base_ + s->offset) {
                    amoe_sim::Fail("TQue::%s: tensor is a sub-view, not the allocated buffer", op);
                }
                return s;
            }
        }
        amoe_sim::Fail("TQue::%s: tensor does not belong to this queue", op);
    }

    uint8_t *base_ = nullptr;
    std::vector<amoe_sim::BufSlot *> slots_;
    std::vector<amoe_sim::BufSlot *> fifo_;
};

template <TPosition POS>
class TBuf {
public:
    template <typename T>
    LocalTensor<T> Get() const
    {
        if (slot_ == nullptr) {
            amoe_sim::Fail("TBuf::Get before TPipe::InitBuffer");
        }
        return LocalTensor<T>(reinterpret_cast<T *>(base_ + slot_->offset), slot_->bytes / sizeof(T), slot_);
    }

private:
    friend class TPipe;
    uint8_t *base_ = nullptr;
    amoe_sim::BufSlot *slot_ = nullptr;
};

class TPipe {
public:
    TPipe()
    {
        amoe_sim::CoreContext &ctx = amoe_sim::Ctx();
        if (ctx.pipe != nullptr) {
            /* One TPipe per kernel: a second one would double-count the UB. */
            amoe_sim::Defer("TPipe: a second TPipe on the same core");
        } else {
            ctx.pipe = &state_;
            CurrentPipe() = this;
        }
    }
    ~TPipe()
    {
        amoe_sim::CoreContext &ctx = amoe_sim::Ctx();
        for (amoe_sim::BufSlot *s : state_.Slots()) {
            if (s->allocated && s->bytes != 0 && !tbufSlots_.count(s)) {
                amoe_sim::Defer("TPipe: kernel returned with a queue tensor still allocated (missing FreeTensor)");
                break;
            }
        }
        state_.ReleaseSlots();
        if (ctx.pipe == &state_) {
            ctx.pipe = nullptr;
            CurrentPipe() = nullptr;
        }
    }
    TPipe(const TPipe &) = delete;
    TPipe &operator=(const TPipe &) = delete;

    template <TPosition POS, int32_t DEPTH>
    void InitBuffer(TQue<POS, DEPTH> &que, uint8_t num, uint32_t len)
    {
        if (!que.slots_.empty()) {
            amoe_sim::Fail("TPipe::InitBuffer: queue initialised twice");
        }
        if (num == 0 || num > DEPTH) {
            amoe_sim::Fail("TPipe::InitBuffer: %u buffers for a queue of depth %d", num, DEPTH);
        }
        for (uint8_t i = 0; i < num; ++i) {
            uint32_t off = state_.Reserve(len, "TQue");
            que.slots_.push_back(state_.NewSlot(off, (len + 31u) / 32u * 32u));
        }
        que.base_ = state_.Base();
    }
    template <TPosition POS>
    void InitBuffer(TBuf<POS> &buf, uint32_t len)
    {
        if (buf.slot_ != nullptr) {
            amoe_sim::Fail("TPipe::InitBuffer: TBuf initialised twice");
        }
        uint32_t off = state_.Reserve(len, "TBuf");
        buf.slot_ = state_.NewSlot(off, (len + 31u) / 32u * 32u);
        buf.slot_->allocated = true;
        tbufSlots_.insert(buf.slot_);
        buf.base_ = state_.Base();
    }
    int32_t FetchEventID(HardEvent) { return 0; }

private:
    struct SlotSet {
        std::vector<amoe_sim::BufSlot *> v;
        void insert(amoe_sim::BufSlot *s) { v.push_back(s); }
        size_t count(amoe_sim::BufSlot *s) const
        {
            for (amoe_sim::BufSlot *x : v) {
                if (x == s) {
                    return 1;
                }
            }
            return 0;
        }
    };
    amoe_sim::PipeState state_;
    SlotSet tbufSlots_;
};

inline TPipe *GetTPipePtr()
{
    if (CurrentPipe() == nullptr) {
        amoe_sim::Fail("GetTPipePtr: no TPipe on this core");
    }
    return CurrentPipe();
}

struct DataCopyExtParams {
    uint16_t blockCount;
    uint32_t blockLen; /* bytes */
    uint32_t srcStride;
    uint32_t dstStride;
    uint32_t rsv;
};

template <typename T>
struct DataCopyPadExtParams {
    bool isPad;
    uint8_t leftPadding;
    uint8_t rightPadding;
    T paddingValue;
};

namespace sim_detail {

inline void CheckUbAddress(const void *p, const char *op)
{
    if (amoe_sim::Ctx().pipe == nullptr) {
        amoe_sim::Fail("%s: no TPipe on this core", op);
    }
    if (amoe_sim::UbOffset(p) % 32u != 0) {
        amoe_sim::Fail("%s: UB address offset %u is not 32-byte aligned", op, amoe_sim::UbOffset(p));
    }
}

template <typename T>
inline void CheckCopyLen(uint32_t count, const char *op)
{
    uint64_t bytes = static_cast<uint64_t>(count) * sizeof(T);
    if (bytes % 32u != 0) {
        amoe_sim::Fail("%s: %u elements = %llu bytes, not a multiple of 32 (use DataCopyPad for tails)", op, count,
                       static_cast<unsigned long long>(bytes));
    }
}

template <typename T>
inline uint32_t PadElems(const DataCopyExtParams &p, const char *op)
{
    if (p.blockCount != 1 || p.srcStride != 0 || p.dstStride != 0) {
        amoe_sim::Fail("%s: only one contiguous block is modelled (blockCount %u, strides %u/%u)", op, p.blockCount,
                       p.srcStride, p.dstStride);
    }
    if (p.blockLen % sizeof(T) != 0) {
        amoe_sim::Fail("%s: blockLen %u bytes is not a whole number of elements", op, p.blockLen);
    }
    return p.blockLen / static_cast<uint32_t>(sizeof(T));
}

} // namespace sim_detail

/* GM -> UB. */
template <typename T>
inline void DataCopy(const LocalTensor<T> &dst, const GlobalTensor<T> &src, uint32_t count)
{
    sim_detail::CheckCopyLen<T>(count, "DataCopy(GM->UB)");
    T *d = dst.Span(0, count, "DataCopy(GM->UB)");
    sim_detail::CheckUbAddress(d, "DataCopy(GM->UB)");
    src.Check(0, count, "DataCopy(GM->UB)");
    std::memcpy(d, src.GetPhyAddr(), static_cast<size_t>(count) * sizeof(T));
}

/* UB -> GM. */
template <typename T>
inline void DataCopy(const GlobalTensor<T> &dst, const LocalTensor<T> &src, uint32_t count)
{
    sim_detail::CheckCopyLen<T>(count, "DataCopy(UB->GM)");
    const T *s = src.Span(0, count, "DataCopy(UB->GM)");
    sim_detail::CheckUbAddress(s, "DataCopy(UB->GM)");
    dst.Check(0, count, "DataCopy(UB->GM)");
    std::memcpy(dst.GetPhyAddr(), s, static_cast<size_t>(count) * sizeof(T));
}

/* UB -> UB. */
template <typename T>
inline void DataCopy(const LocalTensor<T> &dst, const LocalTensor<T> &src, uint32_t count)
{
    sim_detail::CheckCopyLen<T>(count, "DataCopy(UB->UB)");
    T *d = dst.Span(0, count, "DataCopy(UB->UB)");
    const T *s = src.Span(0, count, "DataCopy(UB->UB)");
    sim_detail::CheckUbAddress(d, "DataCopy(UB->UB)");
    sim_detail::CheckUbAddress(s, "DataCopy(UB->UB)");
    std::memmove(d, s, static_cast<size_t>(count) * sizeof(T));
}

/* GM -> UB of any byte length; the UB side is padded up to 32 bytes. */
template <typename T>
inline void DataCopyPad(const LocalTensor<T> &dst, const GlobalTensor<T> &src, const DataCopyExtParams &p,
                        const DataCopyPadExtParams<T> &pad)
{
    uint32_t n = sim_detail::PadElems<T>(p, "DataCopyPad(GM->UB)");
    uint32_t padded = (n * static_cast<uint32_t>(sizeof(T)) + 31u) / 32u * 32u / static_cast<uint32_t>(sizeof(T));
    T *d = dst.Span(0, padded, "DataCopyPad(GM->UB)");
    sim_detail::CheckUbAddress(d, "DataCopyPad(GM->UB)");
    src.Check(0, n, "DataCopyPad(GM->UB)");
    std::memcpy(d, src.GetPhyAddr(), static_cast<size_t>(n) * sizeof(T));
    if (pad.isPad) {
        for (uint32_t i = n; i < padded; ++i) {
            d[i] = pad.paddingValue;
        }
    }
}

/* UB -> GM of any byte length; exactly blockLen bytes reach GM. */
template <typename T>
inline void DataCopyPad(const GlobalTensor<T> &dst, const LocalTensor<T> &src, const DataCopyExtParams &p)
{
    uint32_t n = sim_detail::PadElems<T>(p, "DataCopyPad(UB->GM)");
    const T *s = src.Span(0, n, "DataCopyPad(UB->GM)");
    sim_detail::CheckUbAddress(s, "DataCopyPad(UB->GM)");
    dst.Check(0, n, "DataCopyPad(UB->GM)");
    std::memcpy(dst.GetPhyAddr(), s, static_cast<size_t>(n) * sizeof(T));
}

template <typename T>
inline void Duplicate(const LocalTensor<T> &dst, const T &scalar, int32_t count)
{
    T *d = dst.Span(0, static_cast<uint32_t>(count), "Duplicate");
    for (int32_t i = 0; i < count; ++i) {
        d[i] = scalar;
    }
}

inline void Add(const LocalTensor<float> &dst, const LocalTensor<float> &a, const LocalTensor<float> &b, int32_t count)
{
    float *d = dst.Span(0, static_cast<uint32_t>(count), "Add");
    const float *x = a.Span(0, static_cast<uint32_t>(count), "Add");
    const float *y = b.Span(0, static_cast<uint32_t>(count), "Add");
    for (int32_t i = 0; i < count; ++i) {
        d[i] = x[i] + y[i];
    }
}

inline void Muls(const LocalTensor<float> &dst, const LocalTensor<float> &src, float scalar, int32_t count)
{
    float *d = dst.Span(0, static_cast<uint32_t>(count), "Muls");
    const float *s = src.Span(0, static_cast<uint32_t>(count), "Muls");
    for (int32_t i = 0; i < count; ++i) {
        d[i] = s[i] * scalar;
    }
}

/* Only the conversions the kernels use: exact widening with CAST_NONE and
 * round-to-nearest-even narrowing with CAST_RINT. */
template <typename D, typename S>
inline void Cast(const LocalTensor<D> &dst, const LocalTensor<S> &src, RoundMode mode, uint32_t count)
{
    D *d = dst.Span(0, count, "Cast");
    const S *s = src.Span(0, count, "Cast");
    constexpr bool widen = IsSameType<D, float>::value && (IsSameType<S, half>::value || IsSameType<S, bfloat16_t>::value);
    constexpr bool narrow = IsSameType<S, float>::value && (IsSameType<D, half>::value || IsSameType<D, bfloat16_t>::value);
    static_assert(widen || narrow, "Cast: conversion not modelled by the host simulation");
    if (widen && mode != RoundMode::CAST_NONE) {
        amoe_sim::Fail("Cast: widening to f32 takes CAST_NONE");
    }
    if (narrow && mode != RoundMode::CAST_RINT) {
        amoe_sim::Fail("Cast: narrowing from f32 is only modelled with CAST_RINT");
    }
    for (uint32_t i = 0; i < count; ++i) {
        if constexpr (widen) {
            d[i] = static_cast<float>(s[i]);
        } else {
            d[i] = D(static_cast<float>(s[i]));
        }
    }
}

} // namespace AscendC

#endif /* AMOE_SIM_KERNEL_OPERATOR_H */
