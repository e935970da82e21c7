/* The process's one kernel worker thread (kernel_worker.c, which every kernel library links): its interface, and
 * run_split for a library (f32_linear.c, int8_linear.c, int4_linear.c, layer_ops.c). Before including this, a
 * library defines `job_t` (with `n_end`, the end of the job's range) and declares `static int run_job(const job_t
 * *j);`; kernel_worker.c defines TL_WORKER_IMPL and takes the interface alone. engine/kernels.py hashes this header
 * with each source, so a change here rebuilds every library. */
#ifndef TOKENLOOP_KERNEL_WORKER_H
#define TOKENLOOP_KERNEL_WORKER_H

#include <stdint.h>

#define TL_NO_WORKER 0x544c4e57 /* tl_split's answer when the worker is another caller's or cannot start */

typedef int (*tl_job_fn)(const void *job);

/* fn(mine) here and fn(theirs) on the worker (kernel_worker.c) */
int tl_split(tl_job_fn fn, const void *mine, const void *theirs);
void tl_set_spin_us(int64_t spin_us);

#ifndef TL_WORKER_IMPL
static int run_job_any(const void *j) { return run_job((const job_t *)j); }

/* run `mine` here and `theirs` (the same job, the range after mine's) on the worker; when the worker is busy with
 * another caller or cannot start, run both here */
static int run_split(job_t mine, job_t theirs) {
    const int rc = tl_split(run_job_any, &mine, &theirs);
    if (rc != TL_NO_WORKER) return rc;
    mine.n_end = theirs.n_end;
    return run_job(&mine);
}
#endif

#endif
