/*
 * Force-included (-include) into every translation unit of the host build
 * that includes the Ascend C headers in CPU-debug mode.
 *
 * The CPU-debug headers stop a run on a failed API check with
 * `raise(SIGABRT)` (ASCENDC_ASSERT, ASCENDC_CHECK_VALUE_RANGE) or `abort()`
 * (ASCENDC_DEBUG_ASSERT). In CANN's own CPU debug every core is a forked
 * process, so that kills one core. Here every core runs in the caller's
 * process, so both are routed to the host model, which turns them into a
 * C++ exception that unwinds to the host entry; the entry reports it in the
 * core's status record. The standard headers are included first so their
 * declarations of raise and abort are untouched.
 */
#ifndef AMOE_HOST_MODEL_CPU_DEBUG_HOOKS_H
#define AMOE_HOST_MODEL_CPU_DEBUG_HOOKS_H

#include <csignal>
#include <cstdlib>

[[noreturn]] void amoe_hm_raise(int sig);
[[noreturn]] void amoe_hm_abort();

#define raise(sig) amoe_hm_raise(sig)
#define abort() amoe_hm_abort()

#endif
