/* A C consumer of include/ascend_moe.h: two threads join a CPU world, run a
 * collective and the finalize op, and check the error conventions (also of
 * the NPU-only live context calls, on NULL handles).
 * Exit status 0 = every check passed; otherwise the failing check is printed.
 * Usage: smoke <world-name> */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ascend_moe.h"

static const char *g_name;

#define CHECK(cond, ...)                                                         \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                              \
      fprintf(stderr, "\n");                                                     \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

static const char *last_error(void) {
  static _Thread_local char buf[1024];
  size_t n = 0;
  amoe_last_error_message(buf, sizeof buf, &n);
  return buf;
}

static amoe_tensor host(void *data, uint32_t dtype, size_t ndim, const size_t *shape) {
  amoe_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  t.shape = shape;
  t.strides = NULL;
  t.device_kind = AMOE_DEVICE_KIND_CPU;
  t.device_ordinal = 0;
  return t;
}

/* One rank: all-reduce, then finalize routing on rank-dependent data. */
static int rank_main(size_t rank) {
  amoe_comm *comm = NULL;
  amoe_status s = amoe_comm_cpu_new(g_name, 2, rank, 20.0, &comm);
  CHECK(s == AMOE_STATUS_OK, "rank %zu: amoe_comm_cpu_new: %u %s", rank, (unsigned)s, last_error());
  size_t r = 99, w = 99;
  CHECK(amoe_comm_rank(comm, &r) == AMOE_STATUS_OK && r == rank, "rank %zu got %zu", rank, r);
  CHECK(amoe_comm_world_size(comm, &w) == AMOE_STATUS_OK && w == 2, "world %zu", w);
  /* A handle of another type is refused, not read as the expected one. */
  CHECK(amoe_stream_check((const amoe_stream *)(const void *)comm) == AMOE_STATUS_INVALID_ARGUMENT,
        "a communicator taken for a stream: %s", last_error());
  CHECK(strstr(last_error(), "not a live amoe_stream handle") != NULL, "message: %s", last_error());

  /* all_reduce sum of x_r[i] = (r + 1) * i over 2 ranks: 3 * i. */
  float x[6], y[6];
  size_t shape[2] = {2, 3};
  for (int i = 0; i < 6; i++) x[i] = (float)((rank + 1) * (size_t)i);
  amoe_tensor tx = host(x, AMOE_DTYPE_F32, 2, shape);
  amoe_tensor ty = host(y, AMOE_DTYPE_F32, 2, shape);
  s = amoe_all_reduce(comm, &tx, &ty, AMOE_REDUCE_OP_SUM, NULL);
  CHECK(s == AMOE_STATUS_OK, "all_reduce: %s", last_error());
  for (int i = 0; i < 6; i++) CHECK(y[i] == 3.0f * (float)i, "y[%d] = %f", i, (double)y[i]);

  /* Finalize, mode 0, N = 2 tokens, K = 2, H = 3:
   * out[i] = x1[i] + sum_k scales[i,k] * expanded_x[idx[k*N + i]]. */
  float ex[12], x1[6], sc[4], out[6];
  int32_t idx[4] = {3, 0, 1, 2}; /* R(0,0)=3 R(1,0)=0 R(0,1)=1 R(1,1)=2 */
  for (int i = 0; i < 12; i++) ex[i] = (float)(i + 1) + (float)rank;
  for (int i = 0; i < 6; i++) x1[i] = 0.5f * (float)i;
  sc[0] = 0.25f, sc[1] = 0.75f, sc[2] = 1.0f, sc[3] = -2.0f;
  size_t ex_shape[2] = {4, 3}, idx_shape[1] = {4}, x1_shape[2] = {2, 3}, sc_shape[2] = {2, 2};
  amoe_tensor tex = host(ex, AMOE_DTYPE_F32, 2, ex_shape);
  amoe_tensor tidx = host(idx, AMOE_DTYPE_I32, 1, idx_shape);
  amoe_tensor tx1 = host(x1, AMOE_DTYPE_F32, 2, x1_shape);
  amoe_tensor tsc = host(sc, AMOE_DTYPE_F32, 2, sc_shape);
  amoe_finalize_args args;
  memset(&args, 0, sizeof args);
  args.expanded_x = &tex;
  args.expanded_row_idx = &tidx;
  args.x1 = &tx1;
  args.scales = &tsc;
  args.drop_pad_mode = AMOE_DROP_PAD_MODE_DROP_LESS_COLUMN;
  size_t oshape[AMOE_MAX_NDIM], ondim = 0;
  s = amoe_moe_finalize_routing_output_shape(&args, oshape, AMOE_MAX_NDIM, &ondim);
  CHECK(s == AMOE_STATUS_OK && ondim == 2 && oshape[0] == 2 && oshape[1] == 3, "shape: %s", last_error());
  amoe_tensor tout = host(out, AMOE_DTYPE_F32, ondim, oshape);
  s = amoe_moe_finalize_routing(&args, &tout, NULL);
  CHECK(s == AMOE_STATUS_OK, "finalize: %s", last_error());
  for (int i = 0; i < 2; i++) {
    for (int h = 0; h < 3; h++) {
      double want = x1[i * 3 + h];
      for (int k = 0; k < 2; k++) want += sc[i * 2 + k] * ex[idx[k * 2 + i] * 3 + h];
      CHECK(fabs(out[i * 3 + h] - want) < 1e-5, "out[%d][%d] = %f, want %f", i, h, (double)out[i * 3 + h], want);
    }
  }

  /* Errors: NULL argument, unknown dtype, out of range index; messages name the problem. */
  CHECK(amoe_all_reduce(comm, NULL, &ty, AMOE_REDUCE_OP_SUM, NULL) == AMOE_STATUS_NULL_ARGUMENT, "null src");
  CHECK(strstr(last_error(), "`src` is NULL") != NULL, "message: %s", last_error());
  amoe_tensor bad = host(x, 42, 2, shape);
  CHECK(amoe_all_reduce(comm, &bad, &ty, AMOE_REDUCE_OP_SUM, NULL) == AMOE_STATUS_DTYPE, "bad dtype");
  CHECK(strstr(last_error(), "dtype code 42") != NULL, "message: %s", last_error());
  idx[2] = 7;
  s = amoe_moe_finalize_routing(&args, &tout, NULL);
  CHECK(s == AMOE_STATUS_INDEX_OUT_OF_RANGE, "status %u: %s", (unsigned)s, last_error());
  CHECK(amoe_last_error_length() == strlen(last_error()) + 1, "length query");

  amoe_comm_free(comm);
  amoe_comm_free(NULL);
  return 0;
}

static void *thread_main(void *arg) {
  size_t rank = (size_t)(uintptr_t)arg;
  return (void *)(uintptr_t)rank_main(rank);
}

int main(int argc, char **argv) {
  g_name = argc > 1 ? argv[1] : "amoe-c-smoke";
  printf("ascend-moe %s (header %s)\n", amoe_version(), AMOE_VERSION);
  if (strcmp(amoe_version(), AMOE_VERSION) != 0) {
    fprintf(stderr, "library version %s differs from header %s\n", amoe_version(), AMOE_VERSION);
    return 1;
  }
  /* The context's "every token is real" value is in the header, and is what
   * the defaults hold. */
  amoe_moe_context mctx;
  CHECK(amoe_moe_context_init(&mctx) == AMOE_STATUS_OK, "moe_context_init: %s", last_error());
  CHECK(mctx.num_actual_tokens == AMOE_ALL_TOKENS, "default actual tokens %zu", mctx.num_actual_tokens);
  CHECK(AMOE_ALL_TOKENS == SIZE_MAX, "AMOE_ALL_TOKENS is not SIZE_MAX");
  /* The live context's guard records (NPU only; the handle checks hold here). */
  size_t cap = 0, used = 0;
  CHECK(amoe_live_context_reserve(NULL, 2400) == AMOE_STATUS_NULL_ARGUMENT, "reserve on NULL");
  CHECK(strstr(last_error(), "`ctx` is NULL") != NULL, "message: %s", last_error());
  CHECK(amoe_live_context_guards(NULL, &cap, &used) == AMOE_STATUS_NULL_ARGUMENT, "guards on NULL");
  CHECK(strstr(last_error(), "amoe_live_context_guards") != NULL, "message: %s", last_error());
  pthread_t th[2];
  for (size_t r = 0; r < 2; r++) pthread_create(&th[r], NULL, thread_main, (void *)(uintptr_t)r);
  int failed = 0;
  for (size_t r = 0; r < 2; r++) {
    void *ret = NULL;
    pthread_join(th[r], &ret);
    failed |= (int)(uintptr_t)ret;
  }
  if (!failed) printf("smoke: ok\n");
  return failed;
}
