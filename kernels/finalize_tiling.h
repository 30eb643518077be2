/*
 * Tiling of the native finalize-routing kernel (SPEC.md section 1 and, for the
 * padded variant, section 3).
 *
 * One definition shared by the device kernel (finalize_kernel.cpp), the host
 * build of the same kernel against kernels/sim, and the Rust mirror
 * `FinalizeTiling` (src/backend/npu/kernel/abi.rs, #[repr(C)], checked field
 * by field by src/backend/npu/kernel/tiling_tests.rs through
 * amoe_finalize_tiling_layout()).
 *
 * Every field is a uint32_t so the struct has no padding and the kernel can
 * load it from global memory word by word.
 */
#ifndef AMOE_FINALIZE_TILING_H
#define AMOE_FINALIZE_TILING_H

#include <stdint.h>

/* 'AMF1': rejects a tiling buffer of another layout version. */
#define AMOE_FINALIZE_TILING_MAGIC 0x31464D41u

/* Element types, the crate's DType numbering. */
#define AMOE_DT_F32 0u
#define AMOE_DT_F16 1u
#define AMOE_DT_BF16 2u

/* `flags` bits. */
#define AMOE_FIN_HAS_X1 0x1u
#define AMOE_FIN_HAS_X2 0x2u
#define AMOE_FIN_HAS_BIAS 0x4u
#define AMOE_FIN_HAS_SCALES 0x8u
/* Output is the padded EP buffer [slots * slot_rows, H] of SPEC section 3. */
#define AMOE_FIN_PADDED_OUT 0x10u
/* Token unpermute (SPEC section 1): a row index outside [0, expanded_rows)
 * contributes nothing and is not an error. */
#define AMOE_FIN_SKIP_INVALID_ROWS 0x20u
/* Index check only (what runs before aclnnMoeFinalizeRoutingV2, which never
 * checks index values): nothing is computed; `out` is int32 and receives a
 * copy of expanded_row_idx at element 0 and, with bias, of expert_idx at
 * element AMOE_FIN_CHECKED_EXPERT_OFFSET(n * k), every value outside its
 * range replaced by a safe one (-1 for a row index in the drop-pad modes,
 * else 0) and the first one recorded in the status as usual. The positions
 * are split evenly over the cores. */
#define AMOE_FIN_CHECK_INDICES 0x40u
/* 128 int32 = 512 bytes: the expert copy starts on a 512-byte boundary. */
#define AMOE_FIN_CHECKED_EXPERT_OFFSET(nk) ((((nk) + 127u) / 128u) * 128u)
/* int32 elements a core moves through UB per step of the index check. */
#define AMOE_FIN_CHECK_CHUNK 2048u

/* Order of the global-memory pointers the kernel takes (and of the `gm`
 * array of the host entry). Absent optional inputs may be NULL. */
#define AMOE_FIN_GM_EXPANDED_X 0
#define AMOE_FIN_GM_ROW_IDX 1
#define AMOE_FIN_GM_X1 2
#define AMOE_FIN_GM_X2 3
#define AMOE_FIN_GM_BIAS 4
#define AMOE_FIN_GM_SCALES 5
#define AMOE_FIN_GM_EXPERT_IDX 6
#define AMOE_FIN_GM_OUT 7
/* int32 [slots + 1] prefix sums of local_sizes (padded output only). */
#define AMOE_FIN_GM_SLOT_OFFSETS 8
/* uint32 [block_dim * AMOE_FIN_STATUS_WORDS], one record per core. */
#define AMOE_FIN_GM_STATUS 9
#define AMOE_FIN_GM_COUNT 10

/* Status record of one core: 256 bytes. The kernel writes the first
 * AMOE_FIN_STATUS_HEAD_WORDS words (one 32-byte block); the host simulation
 * writes a NUL-terminated message into the rest when it aborts a run. */
#define AMOE_FIN_STATUS_WORDS 64u
#define AMOE_FIN_STATUS_HEAD_WORDS 8u
#define AMOE_FIN_STATUS_CODE 0     /* one of AMOE_FIN_ST_* */
#define AMOE_FIN_STATUS_POSITION 1 /* flat position in the index tensor */
#define AMOE_FIN_STATUS_VALUE 2    /* the offending value (int32 bits) */
#define AMOE_FIN_STATUS_MESSAGE_BYTE 32u
/* A core that records a problem also writes its head, with word 7 set to
 * AMOE_FIN_STICKY_MARK, to words AMOE_FIN_STICKY_WORD.. of its record. A
 * launch captured into a graph resets only the heads before each replay, so
 * the copy keeps the problem of any replay until the host reads and zeroes
 * the record, also when later replays found none. */
#define AMOE_FIN_STICKY_WORD 56u
#define AMOE_FIN_STICKY_MARK 0x53464D41u

#define AMOE_FIN_ST_OK 0u
#define AMOE_FIN_ST_ROW_INDEX 1u    /* expanded_row_idx out of range */
#define AMOE_FIN_ST_EXPERT_INDEX 2u /* expert_idx out of range */
#define AMOE_FIN_ST_SLOT_LAYOUT 3u  /* slot offsets not a valid layout */
#define AMOE_FIN_ST_BAD_TILING 4u   /* magic, dtype, mode or block count wrong */
#define AMOE_FIN_ST_SIM_VIOLATION 100u /* host simulation aborted the run */
#define AMOE_FIN_ST_NOT_RUN 0xFFFFFFFFu /* host-side sentinel before launch */

/* Unified buffer of one AI Core vector unit on the Atlas A2 (910B) class. */
#define AMOE_UB_BYTES_910B (192u * 1024u)
/* Tiles along H are a multiple of 16 elements: 32 bytes for 16-bit data,
 * 64 bytes for f32, so every full-tile DataCopy is 32-byte aligned. */
#define AMOE_FIN_TILE_ALIGN 16u

typedef struct AmoeFinalizeTiling {
    uint32_t magic;         /* AMOE_FINALIZE_TILING_MAGIC */
    uint32_t n;             /* tokens (output rows before padding) */
    uint32_t k;             /* top-k */
    uint32_t h;             /* elements per row */
    uint32_t expanded_rows; /* rows of expanded_x viewed as 2-D */
    uint32_t experts;       /* rows of bias (0 without bias) */
    uint32_t data_dtype;    /* AMOE_DT_* of expanded_x, x1, x2, bias, out */
    uint32_t scales_dtype;  /* AMOE_DT_* of scales (= data_dtype without scales) */
    uint32_t mode;          /* drop-pad mode 0..3 */
    uint32_t flags;         /* AMOE_FIN_HAS_* | AMOE_FIN_PADDED_OUT */
    uint32_t block_dim;     /* cores the launch uses */
    uint32_t out_rows;      /* n, or slots * slot_rows when padded */
    uint32_t slots;         /* EP ranks of the padded buffer (1 when dense) */
    uint32_t slot_rows;     /* rows per slot (n when dense) */
    uint32_t tile_h;        /* elements per H tile, multiple of AMOE_FIN_TILE_ALIGN */
    uint32_t tiles;         /* ceil(h / tile_h) */
    uint32_t tail_h;        /* elements of the last tile */
    uint32_t rows_per_core; /* out_rows / block_dim */
    uint32_t rows_rem;      /* out_rows % block_dim: the first rows_rem cores take one more */
    uint32_t ub_bytes;      /* unified-buffer bytes the kernel allocates per core */
} AmoeFinalizeTiling;

/* Unified-buffer bytes the kernel allocates for a tile of `tile_h` elements:
 * per element a double-buffered input queue, a bias queue and an output queue
 * of the data type plus one f32 scratch, and for 16-bit data an f32
 * accumulator and an f32 bias scratch; plus one 32-byte status block. */
static inline uint32_t amoe_finalize_ub_bytes(uint32_t data_dtype, uint32_t tile_h)
{
    uint32_t per_elem = (data_dtype == AMOE_DT_F32) ? (4u * 4u + 4u) : (4u * 2u + 3u * 4u);
    return per_elem * tile_h + 32u;
}

#endif /* AMOE_FINALIZE_TILING_H */
