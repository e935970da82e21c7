/* The process's one kernel worker thread (kernel_worker.c, which every kernel library links): its interface, and
 * run_split for a library (f32_linear.c, int8_linear.c, int4_linear.c, layer_ops.c). Before including this, a
 * library defines `job_t` (one part of a job) and declares `static int run_job(const job_t *j);`; kernel_worker.c
 * defines TL_WORKER_IMPL and takes the interface alone. engine/kernels.py hashes this header with each source, so a
 * change here rebuilds every library. */
#ifndef TOKENLOOP_KERNEL_WORKER_H
#define TOKENLOOP_KERNEL_WORKER_H

#include <stdint.h>

#define TL_NO_WORKER 0x544c4e57 /* tl_split's answer when the worker is another caller's or cannot start */

typedef int (*tl_job_fn)(const void *job);

/* The worker's exported symbols carry tokenloop's prefix, tl_ (the libraries share one process).
 * tl_split: run fn(mine) on the calling thread and fn(theirs) on the worker at once, return when both are done
 * (TL_NO_WORKER, having run neither, when the worker is another caller's or cannot start: run_split below). */
int tl_split(tl_job_fn fn, const void *mine, const void *theirs);
/* tl_set_spin_us: how long the worker spins for its next job before it sleeps (kernel_lib.set_spin_us) */
void tl_set_spin_us(int64_t spin_us);

#ifndef TL_WORKER_IMPL
static int run_job_any(const void *j) { return run_job((const job_t *)j); }

/* run `mine` here and `theirs` (another part of the same job: the channels or sequences after mine, or other heads)
 * on the worker; when the worker is busy with another caller or cannot start, both here, one after the other (each
 * part's results do not depend on the thread that computes it) */
static int run_split(job_t mine, job_t theirs) {
    const int rc = tl_split(run_job_any, &mine, &theirs);
    if (rc != TL_NO_WORKER) return rc;
    const int mine_rc = run_job(&mine), theirs_rc = run_job(&theirs);
    return mine_rc != 0 ? mine_rc : theirs_rc;
}
#endif

#endif
