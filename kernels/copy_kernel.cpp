/*
 * Byte copy between arbitrary device addresses, Ascend C (layout and work
 * split in copy_tiling.h).
 *
 * aclrtMemcpyAsync copies on-chip device memory only between 64-byte
 * aligned addresses (acl_rt.h, CANN 8.1 and current). This kernel covers the
 * rest on the stream, so an unaligned device-to-device copy never falls back
 * to a host-synchronising aclrtMemcpy and can be captured into a graph.
 *
 * Every move is a DataCopyPad of uint8_t elements, one burst per tile:
 *  - the Ascend C DataCopyPad reference (CANN 7.0+, Atlas A2) lists
 *    int8_t/uint8_t among its types and gives blockLen in bytes, for
 *    unaligned transfers between GM and VECIN/VECOUT; GM addresses carry no
 *    alignment rule, the local tensor must be 32-byte aligned;
 *  - CANN 8.1.RC1 dav_c220 kernel_operator_data_copy_impl.h,
 *    CheckDataCopyPadParams: blockCount <= 4095 and blockLen <= 2097151
 *    (21 bits) with DataCopyExtParams; GM -> UB needs blockLen % sizeof(T)
 *    == 0, always true for uint8_t; DataCopyPadGm2UBImpl / UB2GMImpl assert
 *    the UB address is 32-byte aligned and lower uint8_t to
 *    copy_gm_to_ubuf_align_b8 / copy_ubuf_to_gm_align_b8.
 * The UB side is always the start of a queue buffer (32-byte aligned, a
 * multiple of 32 bytes long), so a source and a destination of different
 * misalignment need no shifting: each DataCopyPad addresses its own GM side
 * byte-exactly. A tile is 1 .. AMOE_COPY_MAX_TILE bytes: one burst, never
 * zero-length.
 *
 * The TQueBind<VECIN, VECOUT> queue orders the copy-out of a tile after its
 * copy-in (EnQue/DeQue: MTE2 -> MTE3) and the next copy-in into a buffer
 * after its copy-out (FreeTensor/AllocTensor: MTE3 -> MTE2).
 *
 * The tiling arrives as scalar arguments: a kernel's parameters may be
 * basic data types such as int32_t or pointers to them (Ascend C
 * programming guide, "Kernel Function", atlas_ascendc_10_10067), and the
 * <<<>>> launch passes them by value, so nothing is staged in device memory.
 *
 * A tiling the kernel cannot have been planned with (wrong magic, a tile or
 * span that is not a positive multiple of 32) traps: AscendC::Trap
 * "interrupts the running of the AI Core in NPU mode" (Ascend C API
 * reference, Trap, atlasascendc_api_07_0196; dav_c220 TrapImpl issues
 * trap()), an AI Core exception that fails the stream, so a bad launch is
 * never a silent partial copy.
 */
#include "copy_tiling.h"
#include "kernel_operator.h"

using namespace AscendC;

extern "C" __global__ __aicore__ void amoe_copy_kernel(GM_ADDR dst, GM_ADDR src, uint64_t len, uint64_t per_core,
                                                       uint32_t tile, uint32_t dst_phase, uint32_t magic)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    if (magic != AMOE_COPY_TILING_MAGIC || tile == 0 || tile % AMOE_COPY_BLOCK != 0 || tile > AMOE_COPY_MAX_TILE ||
        per_core == 0 || per_core % AMOE_COPY_BLOCK != 0 || dst_phase >= AMOE_COPY_BLOCK) {
        Trap();
        return;
    }
    const uint32_t b = static_cast<uint32_t>(GetBlockIdx());
    const uint32_t cores = static_cast<uint32_t>(GetBlockNum());
    const uint64_t lo = amoe_copy_span_start(len, per_core, dst_phase, b);
    /* The last core runs to the end whatever the split: every byte is copied
     * even when the launch has fewer cores than the tiling planned. */
    const uint64_t hi = b + 1 >= cores ? len : amoe_copy_span_start(len, per_core, dst_phase, b + 1);
    if (lo >= hi) {
        return;
    }
    GlobalTensor<uint8_t> srcGm;
    GlobalTensor<uint8_t> dstGm;
    srcGm.SetGlobalBuffer(reinterpret_cast<__gm__ uint8_t *>(src) + lo, hi - lo);
    dstGm.SetGlobalBuffer(reinterpret_cast<__gm__ uint8_t *>(dst) + lo, hi - lo);
    TPipe pipe;
    TQueBind<QuePosition::VECIN, QuePosition::VECOUT, AMOE_COPY_BUFFERS> que;
    pipe.InitBuffer(que, AMOE_COPY_BUFFERS, tile);
    const DataCopyPadExtParams<uint8_t> noPad{false, 0, 0, 0};
    for (uint64_t off = 0; off < hi - lo; off += tile) {
        const uint32_t n = static_cast<uint32_t>(hi - lo - off < tile ? hi - lo - off : tile);
        const DataCopyExtParams burst{1, n, 0, 0, 0};
        LocalTensor<uint8_t> t = que.AllocTensor<uint8_t>();
        DataCopyPad(t, srcGm[off], burst, noPad);
        que.EnQue(t);
        t = que.DeQue<uint8_t>();
        DataCopyPad(dstGm[off], t, burst);
        que.FreeTensor(t);
    }
}
