/* pause: the sandbox ("infra") process of the e2e pods. Sleeps until SIGTERM or SIGINT,
 * reaps zombies (it is PID 1 of the pod when the PID namespace is shared). Built static by
 * e2e/build_images.py with `gcc -static -Os`; no libc features beyond signals and pause(). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    struct sigaction sa;
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("pause (memqos-shim e2e)");
        return 0;
    }
    if (getpid() != 1) {
        fprintf(stderr, "pause: warning: not PID 1\n");
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = stop;
    if (sigaction(SIGTERM, &sa, NULL) < 0 || sigaction(SIGINT, &sa, NULL) < 0) {
        return 1;
    }
    sa.sa_handler = reap;
    sa.sa_flags = SA_NOCLDSTOP;
    if (sigaction(SIGCHLD, &sa, NULL) < 0) {
        return 2;
    }
    for (;;) {
        pause();
    }
    return 42;
}
