/* The kernels' one worker thread, shared by every kernel library of the process (f32_linear.c, int8_linear.c,
 * int4_linear.c, layer_ops.c: each includes kernel_worker.h and links this library). A two-thread product or
 * attention posts its second half here and runs the first on the calling thread.
 *
 * One worker for all of them, not one each: a decode step runs the int4 layers, then the int8 lm_head, then
 * Python; with a worker per library, the one that ran the layers was still spinning (waiting for its next job) while
 * the lm_head's two threads ran, three runnable threads on two cores, and each library's worker slept and woke on
 * its own. Here the thread that spins for the next job is the one that will get it.
 *
 * The worker spins briefly (tl_set_spin_us, 200 us by default) for the next job, then sleeps on a futex. Built at
 * run time by engine/kernels.py (before the libraries that link it). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define TL_WORKER_IMPL
#include "kernel_worker.h" /* TL_NO_WORKER, tl_job_fn and the prototypes this file defines */

static tl_job_fn job_fn;
static const void *job_arg;
static int job_rc;
static _Atomic uint32_t posted, finished; /* job counters: the caller bumps `posted`, the worker `finished` */
/* 1 while the worker / the caller sleeps (or is about to) on `posted` / `finished`: the other side makes the futex
 * wake syscall only then, not after every job (both spin through most hand-offs within a step) */
static _Atomic uint32_t worker_asleep, caller_asleep;
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER; /* one caller of the worker at a time */
static pid_t worker_pid = 0; /* the process that started the worker (a forked child starts its own) */
static _Atomic int64_t worker_spin_ns = 200000;

/* How long (microseconds) the worker spins for its next job before it sleeps. */
void tl_set_spin_us(int64_t spin_us) { atomic_store(&worker_spin_ns, spin_us < 0 ? 0 : spin_us * 1000); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* wait until *word != seen: spin up to spin_ns, then sleep (futex; a short nap where there is none), with *asleep
 * set while it may sleep. The waker changes *word, then reads *asleep; the sleeper sets *asleep, then reads *word
 * (both sequentially consistent): at least one of them sees the other's write, so a wake is never lost, and
 * FUTEX_WAIT itself returns at once if *word changed after the read. */
static void wait_change(_Atomic uint32_t *word, uint32_t seen, int64_t spin_ns, _Atomic uint32_t *asleep) {
    if (atomic_load_explicit(word, memory_order_acquire) != seen) return;
    const int64_t deadline = now_ns() + spin_ns;
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != seen) return;
        if ((i & 63) == 0) {
            if (now_ns() > deadline) break;
            sched_yield();
        } else {
            cpu_relax();
        }
    }
    atomic_store(asleep, 1);
    while (atomic_load(word) == seen) {
#if defined(__linux__)
        syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
        struct timespec nap = {0, 50000};
        nanosleep(&nap, NULL);
#endif
    }
    atomic_store(asleep, 0);
}

/* after changing *word: wake its waiter if it may be asleep (see wait_change) */
static void wake(_Atomic uint32_t *word, _Atomic uint32_t *asleep) {
#if defined(__linux__)
    if (atomic_load(asleep)) syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#else
    (void)word, (void)asleep;
#endif
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t seen = 0; /* ensure_worker zeroed the counters before starting this thread; a job may be posted already */
    for (;;) {
        wait_change(&posted, seen, atomic_load(&worker_spin_ns), &worker_asleep);
        seen = atomic_load_explicit(&posted, memory_order_acquire);
        job_rc = job_fn(job_arg);
        atomic_fetch_add(&finished, 1);
        wake(&finished, &caller_asleep);
    }
    return NULL;
}

/* the worker of this process, started on first use; 0 when running, < 0 when it cannot be started */
static int ensure_worker(void) {
    if (worker_pid == getpid()) return 0;
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    atomic_store(&posted, 0);
    atomic_store(&finished, 0);
    atomic_store(&worker_asleep, 0);
    atomic_store(&caller_asleep, 0);
    const int rc = pthread_create(&thread, &attr, worker_main, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) return -1;
#if defined(__linux__)
    pthread_setname_np(thread, "tokenloop-kw");
#endif
    worker_pid = getpid();
    return 0;
}

/* fn(mine) here and fn(theirs) on the worker, both finished on return (the first nonzero code, else 0); or
 * TL_NO_WORKER, having run nothing, when the worker is busy with another caller (a second engine in the process, or
 * a job on the worker that splits again) or cannot start: the caller then runs both halves itself */
int tl_split(tl_job_fn fn, const void *mine, const void *theirs) {
    if (pthread_mutex_trylock(&caller_lock) != 0) return TL_NO_WORKER;
    if (ensure_worker() != 0) {
        pthread_mutex_unlock(&caller_lock);
        return TL_NO_WORKER;
    }
    job_fn = fn, job_arg = theirs;
    const uint32_t done_before = atomic_load_explicit(&finished, memory_order_acquire);
    atomic_fetch_add(&posted, 1);
    wake(&posted, &worker_asleep);
    const int rc = fn(mine);
    wait_change(&finished, done_before, 2000000, &caller_asleep);
    const int theirs_rc = job_rc;
    pthread_mutex_unlock(&caller_lock);
    return rc != 0 ? rc : theirs_rc;
}
