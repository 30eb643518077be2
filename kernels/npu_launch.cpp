/*
 * NPU build only (CANN's bisheng/ccec, -xcce): the finalize kernel, the
 * forward-context guard and the byte copy for the AI Core, each with a
 * host-callable launcher, built into libamoe_kernels_npu.so and loaded at
 * run time. Not compiled by the host build (kernels/host_model).
 *
 * `gm` is a host array of AMOE_FIN_GM_COUNT device pointers in the order of
 * finalize_tiling.h (NULL for absent optional inputs); `tiling` is a device
 * copy of the AmoeFinalizeTiling; `stream` is an aclrtStream. The status
 * buffer must hold block_dim records of AMOE_FIN_STATUS_WORDS words.
 */
#include "acl/acl_rt.h"

/*
 * A `<<<>>>` launch returns nothing: a failure (an unregistered kernel, a bad
 * stream, no resources) stays in the runtime's per-thread last error,
 * `aclrtGetLastError(ACL_RT_THREAD_LEVEL)`, which returns it and clears it
 * (hicann/runtime `src/acl/aclrt_impl/context.cpp:202-211` ->
 * `ApiImpl::GetLastErr`, `src/runtime/feature/src/api_impl/api_impl.cc:7437-7451`
 * at v8.5.0; thread level is the only level it accepts). Each launcher clears
 * it before the launch and returns it after, so what it returns is this
 * launch's error. The symbol is weak: a runtime without it (older than the
 * call) leaves the launch unchecked, as before, rather than failing to load.
 */
#pragma weak aclrtGetLastError

static int32_t amoe_last_launch_error(void)
{
    return aclrtGetLastError != nullptr ? static_cast<int32_t>(aclrtGetLastError(ACL_RT_THREAD_LEVEL)) : 0;
}

/* The error code of a launcher's own argument check: ACL_ERROR_INVALID_PARAM
 * (100000, acl_base_rt.h); 107000 is the runtime's ACL_ERROR_RT_PARAM_INVALID
 * (rt_error_codes.h:21), which these checks are not. */
#define AMOE_LAUNCH_INVALID_PARAM 100000

#include "finalize_kernel.cpp"

extern "C" int32_t amoe_finalize_launch_npu(uint32_t block_dim, void *stream, void *const *gm, void *tiling)
{
    if (gm == nullptr || tiling == nullptr || block_dim == 0) {
        return AMOE_LAUNCH_INVALID_PARAM;
    }
    (void)amoe_last_launch_error();
    amoe_finalize_kernel<<<block_dim, nullptr, stream>>>(
        static_cast<GM_ADDR>(gm[AMOE_FIN_GM_EXPANDED_X]), static_cast<GM_ADDR>(gm[AMOE_FIN_GM_ROW_IDX]),
        static_cast<GM_ADDR>(gm[AMOE_FIN_GM_X1]), static_cast<GM_ADDR>(gm[AMOE_FIN_GM_X2]),
        static_cast<GM_ADDR>(gm[AMOE_FIN_GM_BIAS]), static_cast<GM_ADDR>(gm[AMOE_FIN_GM_SCALES]),
        static_cast<GM_ADDR>(gm[AMOE_FIN_GM_EXPERT_IDX]), static_cast<GM_ADDR>(gm[AMOE_FIN_GM_OUT]),
        static_cast<GM_ADDR>(gm[AMOE_FIN_GM_SLOT_OFFSETS]), static_cast<GM_ADDR>(gm[AMOE_FIN_GM_STATUS]),
        static_cast<GM_ADDR>(tiling));
    return amoe_last_launch_error();
}

#include "guard_kernel.cpp"

/* The forward-context guard on one core: `gm` holds AMOE_GUARD_GM_COUNT
 * device pointers (live context, status record); `tiling` is a device copy of
 * the AmoeGuardTiling. */
extern "C" int32_t amoe_guard_launch_npu(void *stream, void *const *gm, void *tiling)
{
    if (gm == nullptr || tiling == nullptr || gm[AMOE_GUARD_GM_LIVE] == nullptr || gm[AMOE_GUARD_GM_STATUS] == nullptr) {
        return AMOE_LAUNCH_INVALID_PARAM;
    }
    (void)amoe_last_launch_error();
    amoe_guard_kernel<<<1, nullptr, stream>>>(static_cast<GM_ADDR>(gm[AMOE_GUARD_GM_LIVE]),
                                              static_cast<GM_ADDR>(gm[AMOE_GUARD_GM_STATUS]),
                                              static_cast<GM_ADDR>(tiling));
    return amoe_last_launch_error();
}

#include "copy_kernel.cpp"

/* The byte copy: `gm` holds AMOE_COPY_GM_COUNT device pointers (dst, src);
 * `tiling` is a host AmoeCopyTiling whose fields become the kernel's scalar
 * arguments, so nothing is copied to the device for the launch. */
extern "C" int32_t amoe_copy_launch_npu(uint32_t block_dim, void *stream, void *const *gm, const void *tiling)
{
    if (gm == nullptr || tiling == nullptr || block_dim == 0 || gm[AMOE_COPY_GM_DST] == nullptr ||
        gm[AMOE_COPY_GM_SRC] == nullptr) {
        return AMOE_LAUNCH_INVALID_PARAM;
    }
    const AmoeCopyTiling *t = static_cast<const AmoeCopyTiling *>(tiling);
    (void)amoe_last_launch_error();
    amoe_copy_kernel<<<block_dim, nullptr, stream>>>(static_cast<GM_ADDR>(gm[AMOE_COPY_GM_DST]),
                                                     static_cast<GM_ADDR>(gm[AMOE_COPY_GM_SRC]), t->len, t->per_core,
                                                     t->tile, t->dst_phase, t->magic);
    return amoe_last_launch_error();
}
