/* STREAM-like triad a[i] = b[i] + s * c[i] over f64 arrays, OpenMP-parallel: the standalone
 * memory-bandwidth reference of ci/bench.sh (the CLI's own triad is the floor; this one checks
 * it). Bytes per pass = 3 arrays (STREAM counting: no write-allocate traffic).
 * Output: one JSON object on stdout (schema in ci/bench/README.md, "triad").
 * Usage: triad [MiB per array, default 128] [passes, default 10] */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    long mib = argc > 1 ? atol(argv[1]) : 128;
    int passes = argc > 2 ? atoi(argv[2]) : 10;
    if (mib <= 0 || passes <= 0) {
        fprintf(stderr, "usage: triad [MiB per array > 0] [passes > 0]\n");
        return 2;
    }
    size_t n = (size_t)mib * 1024 * 1024 / sizeof(double);
    double *a = malloc(n * sizeof(double)), *b = malloc(n * sizeof(double)), *c = malloc(n * sizeof(double));
    if (!a || !b || !c) {
        fprintf(stderr, "triad: cannot allocate 3 x %ld MiB\n", mib);
        return 1;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        a[i] = 0.0;
        b[i] = 1.0;
        c[i] = 2.0;
    }
    const double s = 3.0;
    double best = 1e30;
    for (int p = 0; p < passes; p++) {
        double t0 = omp_get_wtime();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
        double t = omp_get_wtime() - t0;
        if (t < best) best = t;
    }
    /* Check the result so the loop cannot be dropped, and so a broken build is noticed. */
    size_t wrong = 0;
    for (size_t i = 0; i < n; i += 4099) wrong += a[i] != 7.0;
    double bytes = 3.0 * (double)n * sizeof(double);
    printf("{\"bench\": \"triad\", \"impl\": \"c-openmp\", \"threads\": %d, \"bytes\": %.0f, "
           "\"passes\": %d, \"time_us\": %.3f, \"gbps\": %.4f, \"wrong\": %zu}\n",
           omp_get_max_threads(), bytes, passes, best * 1e6, bytes / best / 1e9, wrong);
    free(a);
    free(b);
    free(c);
    return wrong ? 1 : 0;
}
