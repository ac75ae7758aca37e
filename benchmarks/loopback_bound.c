/* Loopback TCP request/reply throughput in C: the bound a Python data path works against.
 *
 * One request of 16 bytes, then the server sends N chunks of CHUNK bytes back on one
 * connection (TCP_NODELAY, blocking send/recv, no user-space copies beyond the kernel's).
 * Prints the median over REPS of N*CHUNK bytes as GB/s (decimal). Built and run by
 * benchmarks/loopback_bound.py; usage: loopback_bound CHUNK [N] [REPS]
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s CHUNK [N] [REPS]\n", argv[0]);
        return 2;
    }
    long chunk = atol(argv[1]);
    int n = argc > 2 ? atoi(argv[2]) : 32, reps = argc > 3 ? atoi(argv[3]) : 30;
    if (chunk <= 0 || n <= 0 || reps <= 0 || reps > 1000) return 2;
    int one = 1, ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (bind(ls, (void *)&a, sizeof a) || listen(ls, 1) || getsockname(ls, (void *)&a, &len))
        return 1;
    char *buf = malloc((size_t)n * chunk);
    if (!buf) return 1;
    memset(buf, 7, (size_t)n * chunk);
    pid_t pid = fork();
    if (pid == 0) {
        int c = accept(ls, 0, 0);
        char req[16];
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        while (recv(c, req, sizeof req, MSG_WAITALL) == sizeof req)
            for (int i = 0; i < n; i++)
                for (long s = 0; s < chunk;) {
                    long k = send(c, buf + (long)i * chunk + s, chunk - s, 0);
                    if (k <= 0) _exit(1);
                    s += k;
                }
        _exit(0);
    }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a)) return 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    double *t = malloc(sizeof(double) * reps);
    long total = (long)n * chunk;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        if (send(s, "0123456789abcdef", 16, 0) != 16) return 1;
        for (long got = 0; got < total;) {
            long k = recv(s, buf + got, total - got, 0);
            if (k <= 0) return 1;
            got += k;
        }
        t[r] = now() - t0;
    }
    qsort(t, reps, sizeof(double), cmp);
    printf("%.4f\n", total / t[reps / 2] / 1e9);
    close(s);
    waitpid(pid, 0, 0);
    return 0;
}
