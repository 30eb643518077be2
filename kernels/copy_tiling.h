/*
 * The byte-copy kernel (copy_kernel.cpp): `len` bytes from `src` to `dst`,
 * both arbitrary device addresses, for the device-to-device copies the
 * asynchronous copy engine refuses (aclrtMemcpyAsync needs 64-byte aligned
 * on-chip addresses, acl_rt.h).
 *
 * Work split: the destination is cut at 32-byte blocks into per-core spans
 * of `per_core` bytes (a multiple of 32). With p = dst % 32 (`dst_phase`),
 * core b copies bytes [max(0, b*per_core - p), min(len, (b+1)*per_core - p))
 * (core 0 from 0, the last core to len), so every boundary between two
 * cores is a 32-byte boundary of dst and no two cores write into one
 * 32-byte block of it. Each core moves its span in tiles of at most
 * `tile` bytes (a multiple of 32) through a double-buffered unified-buffer
 * queue: DataCopyPad GM -> UB, then DataCopyPad UB -> GM.
 *
 * The kernel takes the fields as scalar arguments (an AI Core kernel's
 * parameters are pointers or C built-in types), so a launch needs no device
 * copy of the tiling: nothing is staged and nothing is allocated, also under
 * graph capture. The struct is what the host builds and the simulated
 * runtime passes to the host entry; it is mirrored by
 * `CopyTiling` (src/backend/npu/kernel/copy.rs) and checked field by field
 * through amoe_copy_tiling_layout().
 */
#ifndef AMOE_COPY_TILING_H
#define AMOE_COPY_TILING_H

#include <stdint.h>

/* 'AMC1' */
#define AMOE_COPY_TILING_MAGIC 0x31434D41u

/* Global-memory pointers of a launch (the `gm` array of the host entry). */
#define AMOE_COPY_GM_DST 0
#define AMOE_COPY_GM_SRC 1
#define AMOE_COPY_GM_COUNT 2

/* Destination blocks no two cores share, and the tile granularity (the
 * unified buffer's 32-byte alignment). */
#define AMOE_COPY_BLOCK 32u
/* Queue depth: the copy-in of tile i + 1 overlaps the copy-out of tile i. */
#define AMOE_COPY_BUFFERS 2u
/* Largest tile: two of them use 128 KiB of the 192 KiB unified buffer. */
#define AMOE_COPY_MAX_TILE (64u * 1024u)

typedef struct AmoeCopyTiling {
    uint32_t magic;     /* AMOE_COPY_TILING_MAGIC */
    uint32_t block_dim; /* cores of the launch */
    uint32_t tile;      /* bytes per DataCopyPad: a multiple of 32 in [32, AMOE_COPY_MAX_TILE] */
    uint32_t dst_phase; /* dst % 32 */
    uint64_t len;       /* bytes to copy, > 0 */
    uint64_t per_core;  /* bytes of a core's span: a multiple of 32 */
} AmoeCopyTiling;

/* The first byte core `b` copies (len when it copies none). */
static inline uint64_t amoe_copy_span_start(uint64_t len, uint64_t per_core, uint32_t dst_phase, uint32_t b)
{
    if (b == 0) {
        return 0;
    }
    const uint64_t at = (uint64_t)b * per_core;
    if (at <= dst_phase) {
        return 0;
    }
    return at - dst_phase < len ? at - dst_phase : len;
}

#endif
