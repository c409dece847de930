/* pressure: the workload of the protection benchmark (e2e/guest_pressure.py).
 *
 *   pressure ANON_MIB NFILES FILE_MIB PASSES DIR MODE [PAUSE_MS]
 *
 * Maps ANON_MIB of anonymous memory (no transparent huge pages) and touches every page once,
 * then runs PASSES passes (0: until SIGTERM) over NFILES files of FILE_MIB each in DIR:
 *
 *   write  every pass writes the files anew (truncated, 1 MiB writes) and reads them back:
 *          page cache that must be reclaimed once the files do not fit beside the anon memory;
 *   loop   the files are written once; every pass touches every anon page and reads every
 *          file: a working set that refaults when its file pages were reclaimed.
 *
 * PAUSE_MS (default 0): a sleep after every pass, so that the working set goes idle between
 * passes (a service that is not busy all the time: its pages age on the LRU).
 *
 * One line per pass on stdout, `pressure: pass 3 412.345 ms 1700000000.123` (pass number, its
 * duration on CLOCK_MONOTONIC, CLOCK_REALTIME at its end), and `pressure: done PASSES` at the
 * end (then exit 0). At memory.max with nothing left to reclaim the kernel OOM-kills it.
 * Built static by e2e/build_images.py with `gcc -static`. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024UL * 1024UL)
#define PAGE 4096UL

static char buf[MIB];

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void say(const char *line) {
    if (write(1, line, strlen(line)) < 0) {
        /* nowhere to report to: keep going */
    }
}

static int write_file(const char *path, unsigned long mib) {
    unsigned long i;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        perror(path);
        return -1;
    }
    for (i = 0; i < mib; i++) {
        buf[0] = (char)i;
        if (write(fd, buf, MIB) != (ssize_t)MIB) {
            perror("pressure: write");
            close(fd);
            return -1;
        }
    }
    return close(fd);
}

static int read_file(const char *path) {
    ssize_t n;
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        perror(path);
        return -1;
    }
    while ((n = read(fd, buf, MIB)) > 0) {
    }
    close(fd);
    return n < 0 ? -1 : 0;
}

int main(int argc, char **argv) {
    struct sigaction sa;
    unsigned long anon, nfiles, file_mib, passes, pass, i, pause_ms = 0;
    volatile char *mem = NULL;
    char path[4096], line[160];
    int rewrite;

    if (argc != 7 && argc != 8) {
        fprintf(stderr, "usage: pressure ANON_MIB NFILES FILE_MIB PASSES DIR write|loop [PAUSE_MS]\n");
        return 2;
    }
    anon = strtoul(argv[1], NULL, 10);
    nfiles = strtoul(argv[2], NULL, 10);
    file_mib = strtoul(argv[3], NULL, 10);
    passes = strtoul(argv[4], NULL, 10);
    rewrite = strcmp(argv[6], "write") == 0;
    if (argc == 8) {
        pause_ms = strtoul(argv[7], NULL, 10);
    }
    if (pause_ms > 600000 || anon > 65536 || nfiles > 1000 || file_mib > 65536 || strlen(argv[5]) > 4000 ||
        (!rewrite && strcmp(argv[6], "loop") != 0)) {
        fprintf(stderr, "pressure: bad arguments\n");
        return 2;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = stop;
    if (sigaction(SIGTERM, &sa, NULL) < 0 || sigaction(SIGINT, &sa, NULL) < 0) {
        return 1;
    }
    memset(buf, 0x5a, sizeof(buf));
    if (anon) {
        mem = mmap(NULL, anon * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) {
            perror("pressure: mmap");
            return 1;
        }
        (void)madvise((void *)mem, anon * MIB, MADV_NOHUGEPAGE);
        for (i = 0; i < anon * MIB; i += PAGE) {
            mem[i] = 1;
        }
    }
    snprintf(line, sizeof(line), "pressure: anon %lu MiB %.3f\n", anon, now(CLOCK_REALTIME));
    say(line);
    if (!rewrite) {
        for (i = 0; i < nfiles; i++) {
            snprintf(path, sizeof(path), "%s/f%lu", argv[5], i);
            if (write_file(path, file_mib) < 0) {
                return 1;
            }
        }
        snprintf(line, sizeof(line), "pressure: files %lu x %lu MiB %.3f\n", nfiles, file_mib, now(CLOCK_REALTIME));
        say(line);
    }
    for (pass = 1; passes == 0 || pass <= passes; pass++) {
        double t0 = now(CLOCK_MONOTONIC);
        for (i = 0; i < anon * MIB; i += PAGE) {
            mem[i]++;
        }
        for (i = 0; i < nfiles; i++) {
            snprintf(path, sizeof(path), "%s/f%lu", argv[5], i);
            if (rewrite && write_file(path, file_mib) < 0) {
                return 1;
            }
            if (!rewrite && read_file(path) < 0) {
                return 1;
            }
        }
        for (i = 0; rewrite && i < nfiles; i++) {
            snprintf(path, sizeof(path), "%s/f%lu", argv[5], i);
            if (read_file(path) < 0) {
                return 1;
            }
        }
        snprintf(line, sizeof(line), "pressure: pass %lu %.3f ms %.3f\n", pass,
                 (now(CLOCK_MONOTONIC) - t0) * 1000.0, now(CLOCK_REALTIME));
        say(line);
        if (pause_ms) {
            struct timespec ts = {(time_t)(pause_ms / 1000), (long)(pause_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
    snprintf(line, sizeof(line), "pressure: done %lu\n", passes);
    say(line);
    return 0;
}
