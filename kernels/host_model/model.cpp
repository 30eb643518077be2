/*
 * The host model of one dav-c220 vector core: the intrinsics of tikicpulib's
 * stub_fun.h and the CPU-debug runtime hooks the Ascend C headers lower to.
 *
 * What it enforces (each one aborts the core with a Violation):
 * - unified buffer: 192 KiB per core; every TPipe buffer inside it; every
 *   UB access inside a buffer the TPipe handed out, 32-byte aligned where
 *   the instruction takes a UB address, never to a queue buffer that is free
 *   or still enqueued; no queue buffer still allocated when the core returns;
 * - MTE bursts: burst count 1..4095, burst length >= 1 (DataCopy: 32-byte
 *   units, 16 bits; DataCopyPad: bytes, 21 bits), every GM byte inside a
 *   buffer of the launch;
 * - pipes: MTE2, V, MTE3 and S each run in order, but an instruction may use
 *   another instruction's UB results (or overwrite UB another one reads)
 *   only when a pipe_barrier of its own pipe or a set_flag/wait_flag pair
 *   orders the two. Every UB block remembers its last writer and its last
 *   reader on each pipe; every pipe knows, per pipe, up to which instruction
 *   it has been ordered after. An unordered dependent access is reported as a
 *   hazard (on the hardware it would read stale data or be overwritten).
 *   wait_flag on an event nobody set is a hang on the hardware and reported.
 * - vector ops: count mode (set_mask_count) and normal mode with the
 *   128-bit mask, block and repeat strides; f32 arithmetic rounds per
 *   instruction; f32 -> f16 / bf16 with CAST_RINT rounds to nearest even.
 *
 * Instructions execute when issued; the pipe model decides whether the
 * issue order is one the hardware guarantees. Scalar (S pipe) UB accesses
 * are plain loads and stores in the CPU-debug headers (LocalTensor::GetValue
 * / SetValue), so the model cannot see them: S <-> MTE/V hazards on UB are
 * not detected.
 */
#include <mutex>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "model.h"
#include "stub_fun.h"

int64_t block_idx = 0;
int64_t block_num = 1;
int32_t g_coreType = 2; /* AscendC::AIV: a KERNEL_TYPE_AIV_ONLY kernel runs on vector cores only */
int32_t g_taskRation = 1;
int32_t sub_block_idx = 0;

namespace AscendC {
const int MIX_TYPE = 0;
const int AIC_TYPE = 1;
const int AIV_TYPE = 2;
bool g_isAtomic = false;
} // namespace AscendC

namespace amoe_hm {

void Fail(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    throw Violation(buf);
}

namespace {

constexpr uint32_t kBlock = 32;
constexpr uint32_t kRepeatBytes = 256;

enum Pipe : uint8_t { P_S = 0, P_V, P_MTE2, P_MTE3, P_COUNT };
const char *const kPipeName[P_COUNT] = {"S", "V", "MTE2", "MTE3"};

/* Event ids 0..7 of a pair of pipes (event_t has EVENT_ID0..EVENT_ID7). */
constexpr uint32_t kEvents = 8;

enum class BufState : uint8_t { Free, Allocated, Enqueued };

struct Buffer {
    uint64_t off;
    uint64_t len;
    bool queue; /* TQue buffer (alloc/enqueue/free) rather than a TBuf */
    BufState state;
};

struct UbBlock {
    int32_t owner = -1; /* index into Core::buffers */
    int8_t writer = -1; /* pipe of the last write */
    uint64_t writeSeq = 0;
    const char *writeOp = nullptr;
    uint64_t readSeq[P_COUNT] = {0, 0, 0, 0};
};

struct Event {
    bool set = false;
    uint64_t token[P_COUNT] = {0, 0, 0, 0};
};

struct Core {
    uint8_t *ub = nullptr;
    bool ubFilled = false;
    std::vector<Buffer> buffers;
    std::vector<UbBlock> blocks;
    uint64_t issued[P_COUNT];
    uint64_t ordered[P_COUNT][P_COUNT]; /* ordered[p][q]: p runs after q's first ordered[p][q] instructions */
    Event events[P_COUNT][P_COUNT][kEvents];
    bool maskCount = false;
    uint64_t mask0 = ~0ull, mask1 = ~0ull;
    uint64_t padValue = 0;
    const GmRange *gm = nullptr;
    size_t gmCount = 0;

    void Reset()
    {
        ub = nullptr;
        ubFilled = false;
        buffers.clear();
        blocks.assign(kUbBytes / kBlock, UbBlock{});
        std::memset(issued, 0, sizeof(issued));
        std::memset(ordered, 0, sizeof(ordered));
        for (auto &a : events) {
            for (auto &b : a) {
                for (auto &e : b) {
                    e = Event{};
                }
            }
        }
        maskCount = false;
        mask0 = mask1 = ~0ull;
        padValue = 0;
    }
};

Core g_core;
std::mutex g_lock;

Pipe PipeOf(pipe_t p, const char *what)
{
    switch (p) {
    case PIPE_S:
        return P_S;
    case PIPE_V:
        return P_V;
    case PIPE_MTE2:
        return P_MTE2;
    case PIPE_MTE3:
        return P_MTE3;
    default:
        Fail("%s: pipe %d does not exist on a vector core", what, static_cast<int>(p));
    }
}

uint64_t UbOffset(const void *p, const char *what)
{
    Core &c = g_core;
    const uint8_t *b = static_cast<const uint8_t *>(p);
    if (c.ub == nullptr || b < c.ub || b >= c.ub + kUbBytes) {
        Fail("%s: address %p is not in the unified buffer", what, p);
    }
    return static_cast<uint64_t>(b - c.ub);
}

void RequireAligned(const void *p, const char *what)
{
    const uint64_t off = UbOffset(p, what);
    if (off % kBlock != 0) {
        Fail("%s: UB address offset %" PRIu64 " is not 32-byte aligned", what, off);
    }
}

/* One instruction being issued on a pipe: checks and records its UB accesses. */
class Instr {
public:
    Instr(Pipe p, const char *name) : pipe_(p), name_(name), seq_(++g_core.issued[p]) {}

    void Read(const void *addr, uint64_t bytes) { Touch(addr, bytes, false); }
    void Write(const void *addr, uint64_t bytes) { Touch(addr, bytes, true); }

private:
    void Touch(const void *addr, uint64_t bytes, bool write)
    {
        if (bytes == 0) {
            return;
        }
        Core &c = g_core;
        const uint64_t off = UbOffset(addr, name_);
        if (off + bytes > kUbBytes) {
            Fail("%s: UB access [%" PRIu64 ", %" PRIu64 ") runs past the 192 KiB unified buffer", name_, off,
                 off + bytes);
        }
        for (uint64_t b = off / kBlock; b <= (off + bytes - 1) / kBlock; ++b) {
            UbBlock &blk = c.blocks[b];
            CheckOwner(blk, b * kBlock);
            if (blk.writer >= 0 && !(blk.writer == pipe_ && blk.writeSeq == seq_) &&
                c.ordered[pipe_][blk.writer] < blk.writeSeq) {
                Fail("pipe hazard: %s #%" PRIu64 " (%s) %s UB offset %" PRIu64 ", written by %s #%" PRIu64
                     " (%s) with no PipeBarrier or SetFlag/WaitFlag ordering the two",
                     kPipeName[pipe_], seq_, name_, write ? "overwrites" : "reads", b * kBlock,
                     kPipeName[blk.writer], blk.writeSeq, blk.writeOp);
            }
            if (write) {
                for (int q = 0; q < P_COUNT; ++q) {
                    const uint64_t r = blk.readSeq[q];
                    if (r != 0 && !(q == pipe_ && r == seq_) && c.ordered[pipe_][q] < r) {
                        Fail("pipe hazard: %s #%" PRIu64 " (%s) overwrites UB offset %" PRIu64
                             " that %s #%" PRIu64 " still reads, with no PipeBarrier or SetFlag/WaitFlag "
                             "ordering the two",
                             kPipeName[pipe_], seq_, name_, b * kBlock, kPipeName[q], r);
                    }
                }
                blk.writer = static_cast<int8_t>(pipe_);
                blk.writeSeq = seq_;
                blk.writeOp = name_;
            } else {
                blk.readSeq[pipe_] = seq_;
            }
        }
    }

    void CheckOwner(const UbBlock &blk, uint64_t off) const
    {
        if (blk.owner < 0) {
            Fail("%s: UB offset %" PRIu64 " is outside every buffer the TPipe handed out", name_, off);
        }
        const Buffer &buf = g_core.buffers[static_cast<size_t>(blk.owner)];
        if (buf.queue && buf.state == BufState::Free) {
            Fail("%s: UB offset %" PRIu64 " is in a queue buffer that is free (used after FreeTensor or before "
                 "AllocTensor)",
                 name_, off);
        }
        if (buf.queue && buf.state == BufState::Enqueued) {
            Fail("%s: UB offset %" PRIu64 " is in a queue buffer that is still enqueued (DeQue it first)", name_,
                 off);
        }
    }

    Pipe pipe_;
    const char *name_;
    uint64_t seq_;
};

void CheckGm(const void *addr, uint64_t bytes, const char *what)
{
    const Core &c = g_core;
    const uint8_t *p = static_cast<const uint8_t *>(addr);
    for (size_t i = 0; i < c.gmCount; ++i) {
        const uint8_t *base = static_cast<const uint8_t *>(c.gm[i].base);
        if (base != nullptr && p >= base && p + bytes <= base + c.gm[i].bytes) {
            return;
        }
    }
    for (size_t i = 0; i < c.gmCount; ++i) {
        const uint8_t *base = static_cast<const uint8_t *>(c.gm[i].base);
        if (base != nullptr && p >= base && p < base + c.gm[i].bytes) {
            Fail("%s: GM access of %" PRIu64 " bytes at byte %td of %s runs outside the %" PRIu64
                 "-byte buffer",
                 what, bytes, p - base, c.gm[i].name, c.gm[i].bytes);
        }
    }
    Fail("%s: GM access of %" PRIu64 " bytes at %p is outside every buffer of the launch", what, bytes, addr);
}

void CheckBursts(uint32_t nBurst, uint32_t lenBurst, uint32_t maxLen, const char *what)
{
    if (nBurst < 1 || nBurst > 4095) {
        Fail("%s: burst count %u is outside [1, 4095]", what, nBurst);
    }
    if (lenBurst < 1 || lenBurst > maxLen) {
        Fail("%s: burst length %u is outside [1, %u]", what, lenBurst, maxLen);
    }
}

/* DataCopy: burst length and gaps in 32-byte blocks. */
void CopyBlocks(Pipe pipe, const char *what, uint8_t *dst, bool dstUb, const uint8_t *src, bool srcUb,
                uint16_t nBurst, uint16_t lenBurst, uint16_t srcGap, uint16_t dstGap)
{
    CheckBursts(nBurst, lenBurst, 65535, what);
    if (dstUb) {
        RequireAligned(dst, what);
    }
    if (srcUb) {
        RequireAligned(src, what);
    }
    Instr in(pipe, what);
    const uint64_t len = static_cast<uint64_t>(lenBurst) * kBlock;
    for (uint32_t i = 0; i < nBurst; ++i) {
        const uint8_t *s = src + i * (len + static_cast<uint64_t>(srcGap) * kBlock);
        uint8_t *d = dst + i * (len + static_cast<uint64_t>(dstGap) * kBlock);
        if (srcUb) {
            in.Read(s, len);
        } else {
            CheckGm(s, len, what);
        }
        if (dstUb) {
            in.Write(d, len);
        } else {
            CheckGm(d, len, what);
        }
        std::memmove(d, s, len);
    }
}

/* DataCopyPad GM -> UB: burst length and GM gap in bytes, UB gap in blocks;
 * each burst starts on a 32-byte UB block. */
void CopyPadIn(const char *what, uint8_t *dst, const uint8_t *src, uint32_t esize, uint16_t nBurst,
               uint32_t lenBurst, uint8_t left, uint8_t right, uint32_t srcGap, uint32_t dstGap)
{
    CheckBursts(nBurst, lenBurst, 2097151, what);
    RequireAligned(dst, what);
    if (left * esize > kBlock || right * esize > kBlock) {
        Fail("%s: padding of %u + %u elements exceeds one 32-byte block", what, left, right);
    }
    Instr in(P_MTE2, what);
    const uint64_t ubBurst = (static_cast<uint64_t>(left) * esize + lenBurst + right * esize + kBlock - 1) / kBlock *
                             kBlock;
    for (uint32_t i = 0; i < nBurst; ++i) {
        const uint8_t *s = src + i * (static_cast<uint64_t>(lenBurst) + srcGap);
        uint8_t *d = dst + i * (ubBurst + static_cast<uint64_t>(dstGap) * kBlock);
        CheckGm(s, lenBurst, what);
        in.Write(d, ubBurst);
        for (uint32_t j = 0; j < left; ++j) {
            std::memcpy(d + j * esize, &g_core.padValue, esize);
        }
        std::memmove(d + left * esize, s, lenBurst);
        for (uint32_t j = 0; j < right; ++j) {
            std::memcpy(d + left * esize + lenBurst + j * esize, &g_core.padValue, esize);
        }
    }
}

/* DataCopyPad UB -> GM: burst length and GM gap in bytes, UB gap in blocks. */
void CopyPadOut(const char *what, uint8_t *dst, const uint8_t *src, uint16_t nBurst, uint32_t lenBurst,
                uint32_t srcGap, uint32_t dstGap)
{
    CheckBursts(nBurst, lenBurst, 2097151, what);
    RequireAligned(src, what);
    Instr in(P_MTE3, what);
    const uint64_t ubBurst = (static_cast<uint64_t>(lenBurst) + kBlock - 1) / kBlock * kBlock;
    for (uint32_t i = 0; i < nBurst; ++i) {
        const uint8_t *s = src + i * (ubBurst + static_cast<uint64_t>(srcGap) * kBlock);
        uint8_t *d = dst + i * (static_cast<uint64_t>(lenBurst) + dstGap);
        in.Read(s, lenBurst);
        CheckGm(d, lenBurst, what);
        std::memmove(d, s, lenBurst);
    }
}

/* One vector operand: base address, element size, block and repeat stride
 * (in 32-byte blocks). */
struct Operand {
    uint8_t *base;
    uint32_t esize;
    uint32_t blkStride;
    uint32_t repStride;

    uint8_t *At(uint64_t repeat, uint64_t i) const
    {
        const uint64_t byte = i * esize;
        return base + repeat * repStride * kBlock + (byte / kBlock) * blkStride * kBlock + byte % kBlock;
    }
};

/* Runs `fn(dst, srcs...)` per active element of a vector instruction with
 * `per` elements per 256-byte repeat: in count mode the first mask0
 * elements (repeat ignored), else `repeat` repeats under the mask. */
template <size_t N, typename F>
void Vector(const char *what, const Operand &dst, const Operand *src, uint8_t repeat, F fn)
{
    uint32_t widest = dst.esize;
    for (size_t k = 0; k < N; ++k) {
        widest = src[k].esize > widest ? src[k].esize : widest;
    }
    const uint32_t per = kRepeatBytes / widest;
    RequireAligned(dst.base, what);
    for (size_t k = 0; k < N; ++k) {
        RequireAligned(src[k].base, what);
    }
    Instr in(P_V, what);
    const Core &c = g_core;
    const uint64_t total = c.maskCount ? c.mask0 : static_cast<uint64_t>(repeat) * per;
    for (uint64_t e = 0; e < total; ++e) {
        const uint64_t r = e / per;
        const uint64_t i = e % per;
        if (!c.maskCount) {
            const uint64_t bit = i < 64 ? (c.mask0 >> i) & 1u : (c.mask1 >> (i - 64)) & 1u;
            if (bit == 0) {
                continue;
            }
        }
        uint8_t *s[N > 0 ? N : 1];
        for (size_t k = 0; k < N; ++k) {
            s[k] = src[k].At(r, i);
            in.Read(s[k], src[k].esize);
        }
        uint8_t *d = dst.At(r, i);
        in.Write(d, dst.esize);
        fn(d, s);
    }
}

float LoadF32(const uint8_t *p)
{
    float v;
    std::memcpy(&v, p, 4);
    return v;
}
void StoreF32(uint8_t *p, float v) { std::memcpy(p, &v, 4); }
uint16_t Load16(const uint8_t *p)
{
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}
void Store16(uint8_t *p, uint16_t v) { std::memcpy(p, &v, 2); }

float F16ToF32(uint16_t h)
{
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            exp = 113; /* 127 - 15 + 1 */
            while ((man & 0x400u) == 0) {
                man <<= 1;
                --exp;
            }
            bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

/* f32 -> f16, round to nearest even (CAST_RINT), overflow to inf. */
uint16_t F32ToF16Rne(float f)
{
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t e = (x >> 23) & 0xFFu;
    uint32_t m = x & 0x7FFFFFu;
    if (e == 0xFF) {
        return static_cast<uint16_t>(sign | 0x7C00u | (m != 0 ? 0x200u | (m >> 13) : 0u));
    }
    const int32_t exp = static_cast<int32_t>(e) - 112;
    if (exp >= 31) {
        return static_cast<uint16_t>(sign | 0x7C00u);
    }
    if (exp <= 0) {
        if (exp < -10) {
            return sign;
        }
        m |= 0x800000u;
        const uint32_t shift = static_cast<uint32_t>(14 - exp);
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u);
        const uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (h & 1u) != 0)) {
            ++h;
        }
        return static_cast<uint16_t>(sign | h);
    }
    uint32_t h = (static_cast<uint32_t>(exp) << 10) | (m >> 13);
    const uint32_t rem = m & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0)) {
        ++h; /* a carry into the exponent is the correct rounding, up to inf */
    }
    return static_cast<uint16_t>(sign | h);
}

/* f32 -> bf16, round to nearest even, NaN kept quiet. */
uint16_t F32ToBf16Rne(float f)
{
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return static_cast<uint16_t>((x >> 16) | 0x40u);
    }
    return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

float Bf16ToF32(uint16_t b)
{
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

void Conv(const char *what, void *dst, uint32_t dstSize, void *src, uint32_t srcSize, uint8_t repeat,
          uint32_t dstBlk, uint32_t srcBlk, uint32_t dstRep, uint32_t srcRep, void (*fn)(uint8_t *, const uint8_t *))
{
    const Operand d{static_cast<uint8_t *>(dst), dstSize, dstBlk, dstRep};
    const Operand s[1] = {{static_cast<uint8_t *>(src), srcSize, srcBlk, srcRep}};
    Vector<1>(what, d, s, repeat, [fn](uint8_t *o, uint8_t *const *in) { fn(o, in[0]); });
}

[[noreturn]] void NotModelled(const char *what)
{
    Fail("%s is not modelled on the host (a vector-core kernel of this crate never issues it)", what);
}

/* The last error line of the CPU-debug log, without its location prefix:
 * "[ERROR][Block_0][AIV_0][file:line][Func][pid] text" becomes
 * "Func: text", "[ASSERT] file:line: Assertion `expr' text" becomes "text". */
std::string LastLogError(const std::string &log)
{
    std::string best;
    size_t pos = 0;
    while (pos < log.size()) {
        size_t end = log.find('\n', pos);
        if (end == std::string::npos) {
            end = log.size();
        }
        const std::string line = log.substr(pos, end - pos);
        pos = end + 1;
        if (line.rfind("[ERROR]", 0) == 0) {
            /* Six bracketed fields, the fifth is the function. */
            size_t p = 0;
            std::string func;
            for (int field = 0; field < 6 && p != std::string::npos; ++field) {
                const size_t open = line.find('[', p);
                const size_t close = open == std::string::npos ? open : line.find(']', open);
                if (close == std::string::npos) {
                    p = std::string::npos;
                    break;
                }
                if (field == 4) {
                    func = line.substr(open + 1, close - open - 1);
                }
                p = close + 1;
            }
            best = p == std::string::npos ? line : func + ": " + line.substr(p + (p < line.size() ? 1 : 0));
        } else if (line.rfind("[ASSERT]", 0) == 0) {
            const size_t tick = line.find("' ");
            best = tick == std::string::npos ? line : line.substr(tick + 2);
        }
    }
    while (!best.empty() && (best.back() == ' ' || best.back() == '\r')) {
        best.pop_back();
    }
    return best;
}

} // namespace

std::string RunCore(uint32_t blockIdx, uint32_t blockDim, const GmRange *gm, size_t gmCount, void (*body)(void *),
                    void *ctx)
{
    std::lock_guard<std::mutex> guard(g_lock);
    Core &c = g_core;
    c.Reset();
    c.gm = gm;
    c.gmCount = gmCount;
    block_idx = blockIdx;
    block_num = blockDim;
    g_coreType = 2;
    sub_block_idx = 0;

    /* The CPU-debug headers report failed checks with printf / fprintf: keep
     * them, to attach to the violation (or pass them on after a clean run). */
    std::fflush(stdout);
    std::fflush(stderr);
    char *logBuf = nullptr;
    size_t logLen = 0;
    FILE *mem = open_memstream(&logBuf, &logLen);
    FILE *realOut = stdout;
    FILE *realErr = stderr;
    if (mem != nullptr) {
        stdout = mem;
        stderr = mem;
    }
    std::string violation;
    try {
        body(ctx);
        for (const Buffer &b : c.buffers) {
            if (b.queue && b.state != BufState::Free) {
                Fail("a queue buffer at UB offset %" PRIu64 " is still allocated when the kernel returns "
                     "(missing FreeTensor)",
                     b.off);
            }
        }
    } catch (const Violation &v) {
        violation = v.what();
    } catch (const std::exception &e) {
        violation = std::string("unexpected exception: ") + e.what();
    } catch (...) {
        violation = "unexpected exception";
    }
    std::string log;
    if (mem != nullptr) {
        std::fflush(mem);
        stdout = realOut;
        stderr = realErr;
        std::fclose(mem);
        log.assign(logBuf != nullptr ? logBuf : "", logLen);
        std::free(logBuf);
    }
    const std::string logError = LastLogError(log);
    if (!violation.empty() && !logError.empty()) {
        violation = logError + " (" + violation + ")";
    }
    if (violation.empty() && !log.empty()) {
        std::fwrite(log.data(), 1, log.size(), stdout);
    }
    c.gm = nullptr;
    c.gmCount = 0;
    return violation;
}

} // namespace amoe_hm

using amoe_hm::Fail;
using amoe_hm::g_core;

[[noreturn]] void amoe_hm_raise(int sig)
{
    Fail("an Ascend C API check failed in the CPU-debug headers (raise(%d))", sig);
}

[[noreturn]] void amoe_hm_abort() { Fail("an Ascend C API assertion failed in the CPU-debug headers (abort())"); }

/* ---- runtime hooks of the CPU-debug TPipe / TQue / TBuf ---- */

/* Called by the TPipe constructor once per pool; `hardware` is the headers'
 * Hardware enum (GM, UB, L1, ...), so 1 is the unified buffer. */
void AscendCBufAbsAddr(uint8_t hardware, uint64_t addr, uint64_t len)
{
    if (hardware != 1) {
        return;
    }
    if (len != amoe_hm::kUbBytes) {
        Fail("TPipe: the CPU-debug UB pool is %" PRIu64 " bytes, the model expects %" PRIu64, len,
             amoe_hm::kUbBytes);
    }
    auto &c = g_core;
    c.ub = reinterpret_cast<uint8_t *>(addr);
    c.buffers.clear();
    c.blocks.assign(amoe_hm::kUbBytes / 32, amoe_hm::UbBlock{});
    if (!c.ubFilled) {
        /* Never-written UB reads as garbage, not zeros. */
        std::memset(c.ub, 0xA5, amoe_hm::kUbBytes);
        c.ubFilled = true;
    }
}

void AscendCBufInit(uint8_t bufPos, uint8_t type, uint8_t num, uint64_t addr, uint64_t len)
{
    (void)bufPos;
    auto &c = g_core;
    const uint64_t off = amoe_hm::UbOffset(reinterpret_cast<void *>(addr), "InitBuffer");
    const uint64_t end = off + static_cast<uint64_t>(num) * len;
    if (end > amoe_hm::kUbBytes) {
        Fail("InitBuffer: unified buffer overflow: buffers up to byte %" PRIu64 " exceed the %" PRIu64
             " bytes of one vector core",
             end, amoe_hm::kUbBytes);
    }
    if (off % 32 != 0 || len % 32 != 0) {
        Fail("InitBuffer: buffer at UB offset %" PRIu64 " of %" PRIu64 " bytes is not 32-byte aligned", off, len);
    }
    for (uint8_t i = 0; i < num; ++i) {
        const uint64_t bOff = off + i * len;
        for (uint64_t b = bOff / 32; b < (bOff + len) / 32; ++b) {
            if (c.blocks[b].owner >= 0) {
                Fail("InitBuffer: UB offset %" PRIu64 " belongs to two buffers", b * 32);
            }
            c.blocks[b].owner = static_cast<int32_t>(c.buffers.size());
        }
        c.buffers.push_back({bOff, len, type == 0, amoe_hm::BufState::Free});
    }
}

namespace {
amoe_hm::Buffer &QueueBuffer(uint64_t addr, const char *what)
{
    auto &c = g_core;
    const uint64_t off = amoe_hm::UbOffset(reinterpret_cast<void *>(addr), what);
    const int32_t owner = c.blocks[off / 32].owner;
    if (owner < 0 || c.buffers[static_cast<size_t>(owner)].off != off) {
        Fail("%s: UB offset %" PRIu64 " is not the start of a buffer of the TPipe", what, off);
    }
    return c.buffers[static_cast<size_t>(owner)];
}
} // namespace

void AscendCBufAlloc(uint8_t, uint8_t, uint64_t addr, uint64_t)
{
    amoe_hm::Buffer &b = QueueBuffer(addr, "AllocTensor");
    if (b.state != amoe_hm::BufState::Free) {
        Fail("AllocTensor: the buffer at UB offset %" PRIu64 " is not free (missing FreeTensor)", b.off);
    }
    b.state = amoe_hm::BufState::Allocated;
}

void AscendCBufFree(uint8_t, uint8_t, uint64_t addr, uint64_t)
{
    amoe_hm::Buffer &b = QueueBuffer(addr, "FreeTensor");
    if (b.state == amoe_hm::BufState::Free) {
        Fail("FreeTensor: the buffer at UB offset %" PRIu64 " is already free", b.off);
    }
    if (b.state == amoe_hm::BufState::Enqueued) {
        Fail("FreeTensor: the buffer at UB offset %" PRIu64 " is still enqueued", b.off);
    }
    b.state = amoe_hm::BufState::Free;
}

void AscendCBufEnque(uint8_t, uint8_t, uint8_t, uint64_t addr)
{
    amoe_hm::Buffer &b = QueueBuffer(addr, "EnQue");
    if (b.state != amoe_hm::BufState::Allocated) {
        Fail("EnQue: the buffer at UB offset %" PRIu64 " is not allocated", b.off);
    }
    b.state = amoe_hm::BufState::Enqueued;
}

void AscendCBufDeque(uint8_t, uint8_t, uint8_t, uint64_t addr)
{
    amoe_hm::Buffer &b = QueueBuffer(addr, "DeQue");
    if (b.state != amoe_hm::BufState::Enqueued) {
        Fail("DeQue: the queue is empty (buffer at UB offset %" PRIu64 " was never enqueued)", b.off);
    }
    b.state = amoe_hm::BufState::Allocated;
}

void AscendCBufGet(uint8_t, uint8_t, uint64_t, uint64_t) {}
void AscendCQueCreate(uint8_t, uint8_t, uint8_t) {}
void AscendCUpdateTbufPoolStatus(uint64_t, bool) {}
void AscendCTBufPoolResetCheck(uint8_t, uint64_t, uint64_t, uint64_t) {}

int64_t get_block_num() { return block_num; }
int64_t get_block_idx() { return block_idx; }

/* ---- synchronisation ---- */

void pipe_barrier(pipe_t pipe)
{
    auto &c = g_core;
    if (pipe == PIPE_ALL) {
        for (int p = 0; p < amoe_hm::P_COUNT; ++p) {
            for (int q = 0; q < amoe_hm::P_COUNT; ++q) {
                c.ordered[p][q] = c.issued[q];
            }
        }
        return;
    }
    const amoe_hm::Pipe p = amoe_hm::PipeOf(pipe, "pipe_barrier");
    c.ordered[p][p] = c.issued[p];
}

void set_flag(pipe_t pipe, pipe_t tpipe, event_t id)
{
    auto &c = g_core;
    const amoe_hm::Pipe s = amoe_hm::PipeOf(pipe, "set_flag");
    const amoe_hm::Pipe d = amoe_hm::PipeOf(tpipe, "set_flag");
    if (static_cast<uint32_t>(id) >= amoe_hm::kEvents) {
        Fail("set_flag: event id %d is outside [0, 8)", static_cast<int>(id));
    }
    amoe_hm::Event &e = c.events[s][d][id];
    if (e.set) {
        Fail("set_flag %s -> %s event %d: already set and not yet waited for", amoe_hm::kPipeName[s],
             amoe_hm::kPipeName[d], static_cast<int>(id));
    }
    e.set = true;
    for (int q = 0; q < amoe_hm::P_COUNT; ++q) {
        e.token[q] = c.ordered[s][q];
    }
    e.token[s] = c.issued[s];
}

void wait_flag(pipe_t pipe, pipe_t tpipe, event_t id)
{
    auto &c = g_core;
    const amoe_hm::Pipe s = amoe_hm::PipeOf(pipe, "wait_flag");
    const amoe_hm::Pipe d = amoe_hm::PipeOf(tpipe, "wait_flag");
    if (static_cast<uint32_t>(id) >= amoe_hm::kEvents) {
        Fail("wait_flag: event id %d is outside [0, 8)", static_cast<int>(id));
    }
    amoe_hm::Event &e = c.events[s][d][id];
    if (!e.set) {
        Fail("wait_flag %s -> %s event %d: the event was never set (the core would hang)", amoe_hm::kPipeName[s],
             amoe_hm::kPipeName[d], static_cast<int>(id));
    }
    e.set = false;
    for (int q = 0; q < amoe_hm::P_COUNT; ++q) {
        c.ordered[d][q] = e.token[q] > c.ordered[d][q] ? e.token[q] : c.ordered[d][q];
    }
}

/* ---- vector control registers ---- */

void set_mask_count() { g_core.maskCount = true; }
void set_mask_norm() { g_core.maskCount = false; }
void set_vector_mask(uint64_t mask1, uint64_t mask0)
{
    g_core.mask1 = mask1;
    g_core.mask0 = mask0;
}
void set_mov_pad_val(uint64_t config) { g_core.padValue = config; }
void set_atomic_none() { AscendC::g_isAtomic = false; }
void set_padding(uint64_t) {}
void set_l1_3d_size(uint64_t) {}

/* Scalar bit helpers of the event-id allocator. */
int64_t sff0(uint64_t in)
{
    for (int64_t i = 0; i < 64; ++i) {
        if (((in >> i) & 1u) == 0) {
            return i;
        }
    }
    return -1;
}
uint64_t sbitset0(uint64_t x, int64_t idx) { return x & ~(1ull << idx); }
uint64_t sbitset1(uint64_t x, int64_t idx) { return x | (1ull << idx); }

/* AscendC::Trap(): on the AI Core an exception that fails the stream; here
 * it aborts the core. */
void trap() { amoe_hm::Fail("trap: the kernel raised an AI Core exception"); }

/* The scalar data cache is not modelled: GM is coherent on the host. */
void dcci(__gm__ void *, uint64_t) {}
void dcci(__gm__ void *, uint64_t, uint64_t) {}

/* ---- MTE copies ---- */

void copy_gm_to_ubuf(__ubuf__ void *dst, __gm__ void *src, uint8_t, uint16_t nBurst, uint16_t lenBurst,
                     uint16_t srcStride, uint16_t dstStride)
{
    amoe_hm::CopyBlocks(amoe_hm::P_MTE2, "DataCopy GM->UB (copy_gm_to_ubuf)", static_cast<uint8_t *>(dst), true,
                        static_cast<const uint8_t *>(src), false, nBurst, lenBurst, srcStride, dstStride);
}

void copy_ubuf_to_gm(__gm__ void *dst, __ubuf__ void *src, uint8_t, uint16_t nBurst, uint16_t lenBurst,
                     uint16_t srcStride, uint16_t dstStride)
{
    amoe_hm::CopyBlocks(amoe_hm::P_MTE3, "DataCopy UB->GM (copy_ubuf_to_gm)", static_cast<uint8_t *>(dst), false,
                        static_cast<const uint8_t *>(src), true, nBurst, lenBurst, srcStride, dstStride);
}

/* UB -> UB runs on the vector pipe (the Ascend C DataCopy doc lists
 * VECIN/VECCALC/VECOUT -> VECIN/VECCALC/VECOUT as a PIPE_V copy). */
void copy_ubuf_to_ubuf(__ubuf__ void *dst, __ubuf__ void *src, uint8_t, uint16_t nBurst, uint16_t lenBurst,
                       uint16_t srcStride, uint16_t dstStride)
{
    amoe_hm::CopyBlocks(amoe_hm::P_V, "DataCopy UB->UB (copy_ubuf_to_ubuf)", static_cast<uint8_t *>(dst), true,
                        static_cast<const uint8_t *>(src), true, nBurst, lenBurst, srcStride, dstStride);
}

void copy_gm_to_ubuf_align_b16(__ubuf__ void *dst, __gm__ void *src, uint8_t, uint16_t nBurst, uint32_t lenBurst,
                               uint8_t left, uint8_t right, uint32_t srcGap, uint32_t dstGap)
{
    amoe_hm::CopyPadIn("DataCopyPad GM->UB (copy_gm_to_ubuf_align_b16)", static_cast<uint8_t *>(dst),
                       static_cast<const uint8_t *>(src), 2, nBurst, lenBurst, left, right, srcGap, dstGap);
}

void copy_gm_to_ubuf_align_b32(__ubuf__ void *dst, __gm__ void *src, uint8_t, uint16_t nBurst, uint32_t lenBurst,
                               uint8_t left, uint8_t right, uint32_t srcGap, uint32_t dstGap)
{
    amoe_hm::CopyPadIn("DataCopyPad GM->UB (copy_gm_to_ubuf_align_b32)", static_cast<uint8_t *>(dst),
                       static_cast<const uint8_t *>(src), 4, nBurst, lenBurst, left, right, srcGap, dstGap);
}

void copy_gm_to_ubuf_align_b8(__ubuf__ void *dst, __gm__ void *src, uint8_t, uint16_t nBurst, uint32_t lenBurst,
                              uint8_t left, uint8_t right, uint32_t srcGap, uint32_t dstGap)
{
    amoe_hm::CopyPadIn("DataCopyPad GM->UB (copy_gm_to_ubuf_align_b8)", static_cast<uint8_t *>(dst),
                       static_cast<const uint8_t *>(src), 1, nBurst, lenBurst, left, right, srcGap, dstGap);
}

void copy_ubuf_to_gm_align_b8(__gm__ void *dst, __ubuf__ void *src, uint8_t, uint16_t nBurst, uint32_t lenBurst,
                              uint8_t, uint8_t, uint32_t srcGap, uint32_t dstGap)
{
    amoe_hm::CopyPadOut("DataCopyPad UB->GM (copy_ubuf_to_gm_align_b8)", static_cast<uint8_t *>(dst),
                        static_cast<const uint8_t *>(src), nBurst, lenBurst, srcGap, dstGap);
}

void copy_ubuf_to_gm_align_b16(__gm__ void *dst, __ubuf__ void *src, uint8_t, uint16_t nBurst, uint32_t lenBurst,
                               uint8_t, uint8_t, uint32_t srcGap, uint32_t dstGap)
{
    amoe_hm::CopyPadOut("DataCopyPad UB->GM (copy_ubuf_to_gm_align_b16)", static_cast<uint8_t *>(dst),
                        static_cast<const uint8_t *>(src), nBurst, lenBurst, srcGap, dstGap);
}

void copy_ubuf_to_gm_align_b32(__gm__ void *dst, __ubuf__ void *src, uint8_t, uint16_t nBurst, uint32_t lenBurst,
                               uint8_t, uint8_t, uint32_t srcGap, uint32_t dstGap)
{
    amoe_hm::CopyPadOut("DataCopyPad UB->GM (copy_ubuf_to_gm_align_b32)", static_cast<uint8_t *>(dst),
                        static_cast<const uint8_t *>(src), nBurst, lenBurst, srcGap, dstGap);
}

/* Cube-core and L1 paths: instantiated by the headers, never issued by a
 * vector-only kernel. */
void copy_cbuf_to_bt(uint64_t, __cbuf__ void *, uint16_t, uint16_t, uint16_t, uint16_t, uint16_t)
{
    amoe_hm::NotModelled("copy_cbuf_to_bt");
}
void copy_cbuf_to_gm(__gm__ void *, __cbuf__ void *, uint8_t, uint16_t, uint16_t, uint16_t, uint16_t)
{
    amoe_hm::NotModelled("copy_cbuf_to_gm");
}
void copy_gm_to_cbuf(__cbuf__ void *, __gm__ void *, uint8_t, uint16_t, uint16_t, uint16_t, uint16_t, pad_t)
{
    amoe_hm::NotModelled("copy_gm_to_cbuf");
}
void copy_cbuf_to_fbuf(__fbuf__ void *, __cbuf__ void *, uint16_t, uint16_t, uint16_t, uint16_t)
{
    amoe_hm::NotModelled("copy_cbuf_to_fbuf");
}

/* ---- vector instructions ---- */

namespace amoe_hm {
namespace {
/* Duplicate writes `v` to every active element; it reads no UB. */
template <typename T>
void Dup(T *dst, T v, uint8_t repeat, uint16_t dstBlk, uint8_t dstRep)
{
    const Operand d{reinterpret_cast<uint8_t *>(dst), sizeof(T), dstBlk, dstRep};
    Vector<0>("Duplicate (vector_dup)", d, nullptr, repeat,
              [v](uint8_t *o, uint8_t *const *) { std::memcpy(o, &v, sizeof(T)); });
}
} // namespace
} // namespace amoe_hm

void vector_dup(float *dst, float v, uint8_t repeat, uint16_t dstBlk, uint16_t, uint8_t dstRep, uint8_t)
{
    amoe_hm::Dup(dst, v, repeat, dstBlk, dstRep);
}

void vector_dup(uint16_t *dst, uint16_t v, uint8_t repeat, uint16_t dstBlk, uint16_t, uint8_t dstRep, uint8_t)
{
    amoe_hm::Dup(dst, v, repeat, dstBlk, dstRep);
}

void vadd(float *dst, float *src0, float *src1, uint8_t repeat, uint8_t dstBlk, uint8_t src0Blk, uint8_t src1Blk,
          uint8_t dstRep, uint8_t src0Rep, uint8_t src1Rep)
{
    const amoe_hm::Operand d{reinterpret_cast<uint8_t *>(dst), 4, dstBlk, dstRep};
    const amoe_hm::Operand s[2] = {{reinterpret_cast<uint8_t *>(src0), 4, src0Blk, src0Rep},
                                   {reinterpret_cast<uint8_t *>(src1), 4, src1Blk, src1Rep}};
    amoe_hm::Vector<2>("Add (vadd)", d, s, repeat, [](uint8_t *o, uint8_t *const *in) {
        amoe_hm::StoreF32(o, amoe_hm::LoadF32(in[0]) + amoe_hm::LoadF32(in[1]));
    });
}

void vmuls(float *dst, float *src, float v, uint8_t repeat, uint16_t dstBlk, uint16_t srcBlk, uint16_t dstRep,
           uint16_t srcRep)
{
    const amoe_hm::Operand d{reinterpret_cast<uint8_t *>(dst), 4, dstBlk, dstRep};
    const amoe_hm::Operand s[1] = {{reinterpret_cast<uint8_t *>(src), 4, srcBlk, srcRep}};
    amoe_hm::Vector<1>("Muls (vmuls)", d, s, repeat,
                    [v](uint8_t *o, uint8_t *const *in) { amoe_hm::StoreF32(o, amoe_hm::LoadF32(in[0]) * v); });
}

void vconv_f162f32(float *dst, half *src, uint8_t repeat, uint16_t dstBlk, uint16_t srcBlk, uint8_t dstRep,
                   uint8_t srcRep)
{
    amoe_hm::Conv("Cast f16->f32 (vconv_f162f32)", dst, 4, src, 2, repeat, dstBlk, srcBlk, dstRep, srcRep,
                  [](uint8_t *o, const uint8_t *i) { amoe_hm::StoreF32(o, amoe_hm::F16ToF32(amoe_hm::Load16(i))); });
}

void vconv_bf162f32(float *dst, bfloat16_t *src, uint8_t repeat, uint16_t dstBlk, uint16_t srcBlk, uint16_t dstRep,
                    uint16_t srcRep)
{
    amoe_hm::Conv("Cast bf16->f32 (vconv_bf162f32)", dst, 4, src, 2, repeat, dstBlk, srcBlk, dstRep, srcRep,
                  [](uint8_t *o, const uint8_t *i) { amoe_hm::StoreF32(o, amoe_hm::Bf16ToF32(amoe_hm::Load16(i))); });
}

void vconv_f322f16r(half *dst, float *src, uint8_t repeat, uint16_t dstBlk, uint16_t srcBlk, uint16_t dstRep,
                    uint16_t srcRep)
{
    amoe_hm::Conv("Cast f32->f16 CAST_RINT (vconv_f322f16r)", dst, 2, src, 4, repeat, dstBlk, srcBlk, dstRep, srcRep,
                  [](uint8_t *o, const uint8_t *i) { amoe_hm::Store16(o, amoe_hm::F32ToF16Rne(amoe_hm::LoadF32(i))); });
}

void vconv_f322bf16r(bfloat16_t *dst, float *src, uint8_t repeat, uint16_t dstBlk, uint16_t srcBlk, uint16_t dstRep,
                     uint16_t srcRep)
{
    amoe_hm::Conv("Cast f32->bf16 CAST_RINT (vconv_f322bf16r)", dst, 2, src, 4, repeat, dstBlk, srcBlk, dstRep,
                  srcRep, [](uint8_t *o, const uint8_t *i) {
                      amoe_hm::Store16(o, amoe_hm::F32ToBf16Rne(amoe_hm::LoadF32(i)));
                  });
}

/* The other rounding modes of the narrowing casts: instantiated by Cast,
 * never issued by this crate's kernels, so not modelled. The last two
 * parameters are the repeat strides, 8 bits wide in some intrinsics. */
#define AMOE_VCONV_NOT_MODELLED(name, Dst, Rep, mode)                                                            \
    void name(Dst *, float *, uint8_t, uint16_t, uint16_t, Rep, Rep)                                            \
    {                                                                                                            \
        amoe_hm::NotModelled("Cast " mode " (" #name ")");                                                       \
    }
AMOE_VCONV_NOT_MODELLED(vconv_f322f16, half, uint8_t, "f32->f16 CAST_NONE")
AMOE_VCONV_NOT_MODELLED(vconv_f322f16o, half, uint8_t, "f32->f16 CAST_ODD")
AMOE_VCONV_NOT_MODELLED(vconv_f322f16a, half, uint16_t, "f32->f16 CAST_ROUND")
AMOE_VCONV_NOT_MODELLED(vconv_f322f16c, half, uint16_t, "f32->f16 CAST_CEIL")
AMOE_VCONV_NOT_MODELLED(vconv_f322f16f, half, uint16_t, "f32->f16 CAST_FLOOR")
AMOE_VCONV_NOT_MODELLED(vconv_f322f16z, half, uint16_t, "f32->f16 CAST_TRUNC")
AMOE_VCONV_NOT_MODELLED(vconv_f322bf16a, bfloat16_t, uint16_t, "f32->bf16 CAST_ROUND")
AMOE_VCONV_NOT_MODELLED(vconv_f322bf16c, bfloat16_t, uint16_t, "f32->bf16 CAST_CEIL")
AMOE_VCONV_NOT_MODELLED(vconv_f322bf16f, bfloat16_t, uint16_t, "f32->bf16 CAST_FLOOR")
AMOE_VCONV_NOT_MODELLED(vconv_f322bf16z, bfloat16_t, uint16_t, "f32->bf16 CAST_TRUNC")
#undef AMOE_VCONV_NOT_MODELLED

/* ---- f16 / bf16 storage types of the CPU-debug headers ---- */

namespace float16 {
Fp16T &Fp16T::operator=(const Fp16T &fp)
{
    val = fp.val;
    return *this;
}
Fp16T::operator float() const { return amoe_hm::F16ToF32(val); }
uint16_t Fp16T::Int32ToFp16(const int32_t &iVal) const
{
    /* |v| <= 65504 is exact in f32, anything at or past 65520 rounds to inf. */
    const int64_t v = iVal;
    if (v >= 65520 || v <= -65520) {
        return v > 0 ? 0x7C00u : 0xFC00u;
    }
    return amoe_hm::F32ToF16Rne(static_cast<float>(v));
}
} // namespace float16

namespace bfloat16 {
Bf16T &Bf16T::operator=(const Bf16T &bf)
{
    val = bf.val;
    return *this;
}
uint16_t Bf16T::FloatToBf16(const float &fVal) const { return amoe_hm::F32ToBf16Rne(fVal); }
} // namespace bfloat16
