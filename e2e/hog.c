/* hog: the memory grower of the real-kernel guard scenario (e2e/guest.py).
 *
 *   hog TARGET_MIB [STEP_MS [done-action]]     done-action: sleep (default) or exit
 *
 * Maps TARGET_MIB of anonymous memory (no transparent huge pages, so every step is 256 base
 * pages) and touches it 1 MiB at a time, sleeping STEP_MS (default 20) between steps. After
 * every MiB it prints one line to stdout:
 *
 *   hog: 45 MiB 3.214 s 1700000000.123
 *
 * (MiB touched so far, seconds since start on CLOCK_MONOTONIC, CLOCK_REALTIME at that moment),
 * then, once the target is reached, `hog: done 96 MiB 7.345 s 1700000004.254`, and either
 * exits 0 or sleeps until SIGTERM/SIGINT (exit 0). Sleeping, SIGUSR1 makes it give its memory
 * back to the kernel (`hog: freed 96 MiB ...`) and sleep on: the guard scenario's calm
 * container, whose memory.high the guard restores. Past memory.high the kernel makes the
 * faulting task sleep: the lines come slowly (the crawl). At memory.max the kernel OOM-kills it
 * (exit 137 as the runtime reports it). Built static by e2e/build_images.py with `gcc -static`. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024UL * 1024UL)

static volatile sig_atomic_t free_requested;

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void request_free(int sig) {
    (void)sig;
    free_requested = 1;
}

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void say(const char *what, unsigned long mib, double t0) {
    char line[128];
    int n = snprintf(line, sizeof(line), "hog: %s%lu MiB %.3f s %.3f\n", what, mib,
                     now(CLOCK_MONOTONIC) - t0, now(CLOCK_REALTIME));
    if (n > 0 && write(1, line, (size_t)n) < 0) {
        /* nowhere to report to: keep growing anyway */
    }
}

int main(int argc, char **argv) {
    struct sigaction sa;
    unsigned long target, step_ms = 20, i;
    int exit_when_done = 0;
    char *mem;
    double t0 = now(CLOCK_MONOTONIC);

    if (argc < 2 || argc > 4) {
        fprintf(stderr, "usage: hog TARGET_MIB [STEP_MS [sleep|exit]]\n");
        return 2;
    }
    target = strtoul(argv[1], NULL, 10);
    if (argc > 2) {
        step_ms = strtoul(argv[2], NULL, 10);
    }
    if (argc > 3) {
        exit_when_done = strcmp(argv[3], "exit") == 0;
    }
    if (target == 0 || target > 1024UL * 1024UL) {
        fprintf(stderr, "hog: bad target %s\n", argv[1]);
        return 2;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = stop;
    if (sigaction(SIGTERM, &sa, NULL) < 0 || sigaction(SIGINT, &sa, NULL) < 0) {
        return 1;
    }
    sa.sa_handler = request_free;
    if (sigaction(SIGUSR1, &sa, NULL) < 0) {
        return 1;
    }
    mem = mmap(NULL, target * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        perror("hog: mmap");
        return 1;
    }
    (void)madvise(mem, target * MIB, MADV_NOHUGEPAGE);
    say("start target ", target, t0);
    for (i = 0; i < target; i++) {
        struct timespec pause_ts = {(time_t)(step_ms / 1000), (long)(step_ms % 1000) * 1000000L};
        memset(mem + i * MIB, 0xa5, MIB);
        say("", i + 1, t0);
        if (step_ms) {
            nanosleep(&pause_ts, NULL);
        }
    }
    say("done ", target, t0);
    if (exit_when_done) {
        return 0;
    }
    for (;;) {
        pause();
        if (free_requested) {
            free_requested = 0;
            (void)madvise(mem, target * MIB, MADV_DONTNEED);
            say("freed ", target, t0);
        }
    }
    return 0;
}
