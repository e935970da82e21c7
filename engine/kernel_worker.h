/* The kernels' worker thread (int8_linear.c, int4_linear.c): each library has one, which runs the second half of a
 * two-thread product. A caller posts a job by bumping `posted` and runs its own half; the worker spins briefly for
 * the next job, then sleeps on a futex. Before including this, a source defines `job_t` (with `n_end` and `rc`),
 * declares `static int run_job(const job_t *j);` and defines WORKER_THREAD_NAME. engine/kernels.py hashes this
 * header with each source, so a change here rebuilds both. */
#ifndef TOKENLOOP_KERNEL_WORKER_H
#define TOKENLOOP_KERNEL_WORKER_H

static job_t job;
static _Atomic uint32_t posted, finished; /* job counters: the caller bumps `posted`, the worker `finished` */
/* 1 while the worker / the caller sleeps (or is about to) on `posted` / `finished`: the other side makes the futex
 * wake syscall only then, not after every job (both spin through most hand-offs within a step) */
static _Atomic uint32_t worker_asleep, caller_asleep;
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER; /* one caller of the worker at a time */
static pid_t worker_pid = 0;  /* the process that started the worker (a forked child starts its own) */
static int64_t worker_spin_ns = 200000;

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
        wait_change(&posted, seen, worker_spin_ns, &worker_asleep);
        seen = atomic_load_explicit(&posted, memory_order_acquire);
        job.rc = run_job(&job);
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
    pthread_setname_np(thread, WORKER_THREAD_NAME);
#endif
    worker_pid = getpid();
    return 0;
}

/* run `mine` here and `theirs` (the same product, the channels after mine's) on the worker; when the worker is
 * busy with another caller (a second engine in the process) or cannot start, run both here */
static int run_split(job_t mine, job_t theirs) {
    int have_worker = pthread_mutex_trylock(&caller_lock) == 0;
    if (have_worker && ensure_worker() != 0) {
        pthread_mutex_unlock(&caller_lock);
        have_worker = 0;
    }
    if (!have_worker) {
        mine.n_end = theirs.n_end;
        return run_job(&mine);
    }
    job = theirs;
    const uint32_t done_before = atomic_load_explicit(&finished, memory_order_acquire);
    atomic_fetch_add(&posted, 1);
    wake(&posted, &worker_asleep);
    const int rc = run_job(&mine);
    wait_change(&finished, done_before, 2000000, &caller_asleep);
    const int theirs_rc = job.rc;
    pthread_mutex_unlock(&caller_lock);
    return rc != 0 ? rc : theirs_rc;
}

#endif
