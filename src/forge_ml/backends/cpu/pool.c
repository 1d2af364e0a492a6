/* pool.c: the CPU kernels' thread pool (its interface is in cpu_kernels.h).

   A job is `count` items (heads, blocks of rows, chunks of elements) taken
   `grain` at a time from a shared counter by the caller and the workers alike, so a worker
   that wakes late only takes fewer. Every kernel makes an item's result independent of
   the thread that computes it (per-item scratch, per-block partial sums added up in order by
   the caller afterwards), so the thread count never changes a bit.
   Where the pool runs the matrix products too (gemm_f32; OpenBLAS keeps one thread), a worker
   spins for POOL_SPIN_NS between jobs, then sleeps on a condition variable; beside
   OpenBLAS's own threads it sleeps at once (two pools, each spinning while the other works,
   fought over a small machine's cores). The caller, once the counter is spent, waits only
   for the workers that joined (they are busy with their last items). A job that finds the
   pool in use (two Python threads at once) runs on its caller alone; a child of fork()
   starts with no workers. forge_set_threads sets the size (the caller included).
*/
#include "cpu_kernels.h"

static int pool_spins;              /* workers spin between jobs (pool_spin_between_jobs) */

void pool_spin_between_jobs(int on) { pool_spins = on; }

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int threads;                    /* the size asked for, the caller included */
    int started;                    /* workers running */
    int forked_hook;                /* pthread_atfork registered */
    unsigned long job;              /* bumped once per job */
    task_fn fn;                     /* the open job (NULL once its caller has finished) */
    void* ctx;
    work_t* work;
    int helpers;                    /* workers asked to join the open job */
    int joined;                     /* workers that joined it */
    int left;                       /* atomic: joined workers still working */
    int busy;                       /* atomic: a caller owns the pool */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, 0, 0, NULL, NULL, NULL,
          0, 0, 0, 0};

/* How long a worker spins for the next job before it sleeps: a training step's kernels come
   tens to hundreds of microseconds apart, and a wake from sleep costs 10 us or more a job.
   GPT-2's CPU decoding step (a product every ~400 us) gave 39.8 tok/s with 200 us, 47.3
   with 1 ms, where OpenBLAS's own threads gave 49.9-50.7 (the same within its runs). */
#define POOL_SPIN_NS 1000000L

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void* pool_worker(void* arg) {
    const int id = (int)(intptr_t)arg;                     /* 1, 2, ... */
    pthread_mutex_lock(&pool.mu);
    unsigned long seen = pool.job;
    for (;;) {
        pthread_mutex_unlock(&pool.mu);
        const long until = now_ns() + POOL_SPIN_NS;
        for (int i = 1; pool_spins && __atomic_load_n(&pool.job, __ATOMIC_ACQUIRE) == seen; ++i) {
            cpu_relax();
            if (i % 256 == 0 && now_ns() > until) break;
        }
        pthread_mutex_lock(&pool.mu);
        while (pool.job == seen) pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.job;
        if (pool.fn == NULL || id > pool.helpers) continue;
        const task_fn fn = pool.fn;
        void* ctx = pool.ctx;
        work_t* work = pool.work;
        pool.joined++;
        pthread_mutex_unlock(&pool.mu);
        fn(ctx, work);
        __atomic_fetch_sub(&pool.left, 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&pool.mu);
    }
    return NULL;
}

/* In a fork()ed child: the workers are the parent's; start again with none. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
    pool.fn = NULL;
    pool.busy = 0;
}

/* The pool's size, the caller included (1: every job runs on its caller). */
void forge_set_threads(int n) {
    pool.threads = n < 1 ? 1 : n > POOL_MAX ? POOL_MAX : n;
}

int forge_get_threads(void) { return pool.threads; }

/* Run `fn` on the caller and up to threads - 1 workers over count items, grain at a time. */
void pool_run(task_fn fn, void* ctx, long count, long grain) {
    work_t work = {count, grain < 1 ? 1 : grain, 0};
    const long chunks = (count + work.grain - 1) / work.grain;
    int helpers = pool.threads - 1;
    if (helpers > chunks - 1) helpers = (int)(chunks - 1);
    if (helpers <= 0 || __atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) {
        fn(ctx, &work);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    if (!pool.forked_hook) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        pool.forked_hook = 1;
    }
    while (pool.started < helpers) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, pool_worker, (void*)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    if (helpers > pool.started) helpers = pool.started;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.work = &work;
    pool.helpers = helpers;
    pool.joined = 0;
    __atomic_store_n(&pool.left, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&pool.job, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, &work);                                         /* the caller's share */
    pthread_mutex_lock(&pool.mu);
    pool.fn = NULL;                                         /* closed to late workers */
    const int joined = pool.joined;
    pthread_mutex_unlock(&pool.mu);
    /* the joined workers decrement `left` from 0: wait until it reaches -joined */
    while (__atomic_load_n(&pool.left, __ATOMIC_ACQUIRE) != -joined) sched_yield();
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
}
