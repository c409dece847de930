/* nginx: the web server of the critest images (e2e/critest_images.py), standing in for nginx.
 * It does what critest's specs look at, nothing more:
 *  - answers every HTTP request with 200 and a small page (GET and HEAD; the request is read up
 *    to its blank line, at most 8 KiB, with a 10 s receive timeout; one connection at a time);
 *  - listens on port 80, or on PORT with `-l PORT` (the host-network image serves 12003); on
 *    IPv6 and IPv4 when the network namespace has IPv6, else on IPv4;
 *  - writes its PID to /var/run/nginx.pid (`-P FILE` for another path) once it listens;
 *  - runs as a process whose name is "nginx" (this file is installed as /usr/sbin/nginx, and
 *    the kernel names a process after the file it executes) and whose command line reads
 *    "nginx: master process ...": at start it executes itself again with that title as argv[0];
 *  - ends on SIGTERM, SIGINT and SIGQUIT also as PID 1 of its container.
 * `-g ARG` is accepted and ignored, so that the usual `nginx -g 'daemon off;'` command works.
 * Built static by e2e/critest_images.py with `gcc -static -Os`. */
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define TITLE "nginx: master process "
#define MAX_REQUEST 8192

static const char page[] =
    "<!DOCTYPE html>\n<html><head><title>Welcome</title></head>"
    "<body><p>memqos-shim e2e web server</p></body></html>\n";

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static int listen_on(int port) {
    int one = 1, zero = 0, fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd >= 0) {
        struct sockaddr_in6 a6;
        memset(&a6, 0, sizeof(a6));
        a6.sin6_family = AF_INET6;
        a6.sin6_port = htons((unsigned short)port);
        a6.sin6_addr = in6addr_any;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        if (bind(fd, (struct sockaddr *)&a6, sizeof(a6)) == 0 && listen(fd, 64) == 0) {
            return fd;
        }
        close(fd);
    }
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        return -1;
    }
    struct sockaddr_in a4;
    memset(&a4, 0, sizeof(a4));
    a4.sin_family = AF_INET;
    a4.sin_port = htons((unsigned short)port);
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&a4, sizeof(a4)) < 0 || listen(fd, 64) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return;
        }
        buf += n;
        len -= (size_t)n;
    }
}

static void serve(int conn) {
    char req[MAX_REQUEST + 1];
    size_t got = 0;
    struct timeval tv = {10, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    while (got < MAX_REQUEST) {
        ssize_t n = read(conn, req + got, MAX_REQUEST - got);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return;
        }
        got += (size_t)n;
        req[got] = '\0';
        if (strstr(req, "\r\n\r\n") || strstr(req, "\n\n")) {
            break;
        }
    }
    req[got] = '\0';
    char head[256];
    int head_only = strncmp(req, "HEAD ", 5) == 0;
    int len = snprintf(head, sizeof(head),
                       "HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: text/html\r\n"
                       "Content-Length: %zu\r\nConnection: close\r\n\r\n", sizeof(page) - 1);
    write_all(conn, head, (size_t)len);
    if (!head_only) {
        write_all(conn, page, sizeof(page) - 1);
    }
}

/* argv[0] becomes "nginx: master process <the command line>", argv[1] the port, argv[2] the
 * PID file; the kernel takes the process name from the path executed (/usr/sbin/nginx). */
static void retitle(int argc, char **argv, const char *port, const char *pidfile) {
    char exe[4096], title[1024];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) {
        return;
    }
    exe[n] = '\0';
    size_t used = (size_t)snprintf(title, sizeof(title), "%s", TITLE);
    for (int i = 0; i < argc && used < sizeof(title); i++) {
        used += (size_t)snprintf(title + used, sizeof(title) - used, "%s%s", i ? " " : "", argv[i]);
    }
    char *args[] = {title, (char *)port, (char *)pidfile, NULL};
    execv(exe, args);
}

int main(int argc, char **argv) {
    const char *port = "80", *pidfile = "/var/run/nginx.pid";
    if (argc == 3 && strncmp(argv[0], TITLE, strlen(TITLE)) == 0) {
        port = argv[1];
        pidfile = argv[2];
    } else {
        for (int i = 1; i < argc; i++) {
            if (i + 1 < argc && strcmp(argv[i], "-l") == 0) {
                port = argv[++i];
            } else if (i + 1 < argc && strcmp(argv[i], "-P") == 0) {
                pidfile = argv[++i];
            } else if (i + 1 < argc && strcmp(argv[i], "-g") == 0) {
                i++;
            } else {
                fprintf(stderr, "usage: nginx [-l PORT] [-P PIDFILE] [-g IGNORED]\n");
                return 2;
            }
        }
        retitle(argc, argv, port, pidfile);
        /* not re-executed (no /proc): serve under the original command line */
    }
    char *end;
    long p = strtol(port, &end, 10);
    if (*end != '\0' || p < 1 || p > 65535) {
        fprintf(stderr, "nginx: bad port %s\n", port);
        return 2;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGQUIT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    int fd = listen_on((int)p);
    if (fd < 0) {
        perror("nginx: listen");
        return 1;
    }
    FILE *f = fopen(pidfile, "w");
    if (f == NULL || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f) != 0) {
        perror("nginx: pid file");
        return 1;
    }
    fprintf(stderr, "nginx: listening on port %ld, pid %d\n", p, (int)getpid());
    for (;;) {
        int conn = accept(fd, NULL, NULL);
        if (conn < 0) {
            continue;
        }
        serve(conn);
        close(conn);
    }
    return 0;
}
