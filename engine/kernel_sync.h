/* Spin-then-sleep waiting shared by the kernels' worker threads (int8_linear.c, int4_linear.c): a caller posts a
 * job by bumping a counter and the worker waits for it to change (and the other way round for "finished"). Included
 * by each kernel source; engine/kernels.py hashes this header with the source, so a change rebuilds both. */
#ifndef TOKENLOOP_KERNEL_SYNC_H
#define TOKENLOOP_KERNEL_SYNC_H

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

/* wait until *word != seen: spin up to spin_ns, then sleep (futex; a short nap where there is none) */
static void wait_change(_Atomic uint32_t *word, uint32_t seen, int64_t spin_ns) {
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
    while (atomic_load_explicit(word, memory_order_acquire) == seen) {
#if defined(__linux__)
        syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
        struct timespec nap = {0, 50000};
        nanosleep(&nap, NULL);
#endif
    }
}

static void wake(_Atomic uint32_t *word) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#else
    (void)word;
#endif
}

#endif
