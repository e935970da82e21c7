/* run_split for a kernel library (f32_linear.c, int8_linear.c, int4_linear.c, layer_ops.c) over the process's one
 * worker thread (kernel_worker.c, which the library links). Before including this, a source defines `job_t` (with
 * `n_end`, the end of the job's range) and declares `static int run_job(const job_t *j);`. engine/kernels.py hashes
 * this header with each source, so a change here rebuilds every library. */
#ifndef TOKENLOOP_KERNEL_WORKER_H
#define TOKENLOOP_KERNEL_WORKER_H

#define TL_NO_WORKER 0x544c4e57
int tl_split(int (*fn)(const void *job), const void *mine, const void *theirs);

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
