/*
 * The forward-context guard kernel (guard_kernel.cpp): one core compares the
 * live forward context, a small device buffer the engine rewrites before each
 * graph replay, with the context an op was captured for.
 *
 * The live context is AMOE_CTX_WORDS uint32 words (256 bytes, so one
 * 32-byte-aligned DataCopy moves it whole):
 *
 *   [0] AMOE_CTX_MAGIC    [1] AMOE_CTX_VERSION  [2] comm type   [3] SP (0/1)
 *   [4] PCP size          [5] actual tokens of this DP rank (AMOE_CTX_ALL = all)
 *   [6] DP size           [7 ..] tokens of each DP rank
 *
 * The tiling carries the expected words, a mask of the words to compare
 * (bit i of mask[i / 32]) and at most one word with a second accepted value. The first differing word is written to the status
 * record (the finalize kernel's record layout): code, word index, live value,
 * expected value.
 *
 * One definition shared by the kernel, its host build and the Rust mirror
 * (src/backend/npu/kernel/guard.rs), checked field by field through
 * amoe_guard_tiling_layout().
 */
#ifndef AMOE_GUARD_TILING_H
#define AMOE_GUARD_TILING_H

#include <stdint.h>

/* 'AMFC' */
#define AMOE_CTX_MAGIC 0x43464D41u
#define AMOE_CTX_VERSION 1u
#define AMOE_CTX_WORDS 64u
#define AMOE_CTX_W_MAGIC 0u
#define AMOE_CTX_W_VERSION 1u
#define AMOE_CTX_W_COMM_TYPE 2u
#define AMOE_CTX_W_SP 3u
#define AMOE_CTX_W_PCP 4u
#define AMOE_CTX_W_ACTUAL 5u
#define AMOE_CTX_W_DP_SIZE 6u
#define AMOE_CTX_W_DP_TOKENS 7u
#define AMOE_CTX_MAX_DP (AMOE_CTX_WORDS - AMOE_CTX_W_DP_TOKENS)
#define AMOE_CTX_ALL 0xFFFFFFFFu

/* 'AMG2' */
#define AMOE_GUARD_TILING_MAGIC 0x32474D41u
#define AMOE_GUARD_NO_ALT 0xFFFFFFFFu

/* Global-memory pointers of a launch. */
#define AMOE_GUARD_GM_LIVE 0
#define AMOE_GUARD_GM_STATUS 1
#define AMOE_GUARD_GM_COUNT 2

/* Status codes (the record layout and AMOE_FIN_ST_OK / _BAD_TILING / _SIM_VIOLATION
 * are the finalize kernel's). */
#define AMOE_GUARD_ST_MISMATCH 10u
/* Word 3 of the status head: the expected value of the differing word. */
#define AMOE_GUARD_STATUS_EXPECTED 3
/* A mismatch is also written, as a copy of the head whose word 7 is
 * AMOE_GUARD_STICKY_MARK, to the last 32 bytes of the record (word
 * AMOE_GUARD_STICKY_WORD). A launch captured into a graph resets only the
 * head before each replay, so the copy keeps the mismatch of any replay
 * until the host reads and zeroes the record, also when later replays
 * match. */
#define AMOE_GUARD_STICKY_WORD 56u
#define AMOE_GUARD_STICKY_MARK 0x53474D41u

typedef struct AmoeGuardTiling {
    uint32_t magic; /* AMOE_GUARD_TILING_MAGIC */
    uint32_t words; /* words compared: <= AMOE_CTX_WORDS */
    uint32_t mask[AMOE_CTX_WORDS / 32u];
    uint32_t expected[AMOE_CTX_WORDS];
    /* One compared word may also equal alt_value (AMOE_GUARD_NO_ALT: none):
     * "every token is real" is AMOE_CTX_ALL or this DP rank's token count. */
    uint32_t alt_word;
    uint32_t alt_value;
} AmoeGuardTiling;

#endif
