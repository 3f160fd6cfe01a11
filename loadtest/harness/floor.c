/* The fan-out floor: one send() per frame, nothing else, on loopback TCP.
 *
 * Built with cc at run time by loadtest/harness/floor.py, which writes the
 * plan and the frames and reads the one JSON line this prints.
 *
 *   floor PLAN FRAMES SECONDS EVENTS_PER_S SNDBUF SENDER_CPUS READER_CPUS
 *
 * PLAN: "sockets games" then, per game, its watchers' socket indexes.
 * FRAMES: per game, a 4-byte little-endian length and the complete
 * WebSocket frame (header and payload, unmasked) our server writes for it.
 *
 * The sender connects to itself (a listener on 127.0.0.1), forks a reader
 * that drains every client end with epoll, and then sends: event i goes to
 * game i mod games, one blocking send() per watcher. EVENTS_PER_S 0 sends
 * in a closed loop. Only the sender's CPU time (getrusage, RUSAGE_SELF) is
 * counted: the reader stands in for the clients, whose CPU is not the
 * server's either.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

static void die(const char *what) {
    perror(what);
    exit(2);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static void pin(const char *list) {
    /* "" leaves the affinity alone; else a comma-separated CPU list. */
    if (list[0] == '\0') return;
    cpu_set_t set;
    CPU_ZERO(&set);
    char *copy = strdup(list), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        CPU_SET(atoi(tok), &set);
    free(copy);
    if (sched_setaffinity(0, sizeof set, &set) != 0) die("sched_setaffinity");
}

static void drain(int *fds, int n) {
    int ep = epoll_create1(0);
    if (ep < 0) die("epoll_create1");
    for (int i = 0; i < n; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = fds[i]};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fds[i], &ev) != 0) die("epoll_ctl");
    }
    static char buf[1 << 16];
    struct epoll_event events[256];
    int open = n;
    while (open > 0) {
        int ready = epoll_wait(ep, events, 256, -1);
        if (ready < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int i = 0; i < ready; i++) {
            ssize_t got = read(events[i].data.fd, buf, sizeof buf);
            if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
                epoll_ctl(ep, EPOLL_CTL_DEL, events[i].data.fd, NULL);
                close(events[i].data.fd);
                open--;
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: floor PLAN FRAMES SECONDS EVENTS_PER_S SNDBUF SENDER_CPUS "
                        "READER_CPUS\n");
        return 2;
    }
    double seconds = atof(argv[3]), rate = atof(argv[4]);
    int sndbuf = atoi(argv[5]);

    FILE *plan = fopen(argv[1], "r");
    if (!plan) die("plan");
    int sockets, games;
    if (fscanf(plan, "%d %d", &sockets, &games) != 2) die("plan header");
    int **watchers = calloc(games, sizeof *watchers);
    int *counts = calloc(games, sizeof *counts);
    for (int g = 0; g < games; g++) {
        if (fscanf(plan, "%d", &counts[g]) != 1) die("plan count");
        watchers[g] = calloc(counts[g] + 1, sizeof **watchers);
        for (int k = 0; k < counts[g]; k++)
            if (fscanf(plan, "%d", &watchers[g][k]) != 1) die("plan watcher");
    }
    fclose(plan);

    FILE *framefile = fopen(argv[2], "rb");
    if (!framefile) die("frames");
    char **frames = calloc(games, sizeof *frames);
    uint32_t *lengths = calloc(games, sizeof *lengths);
    for (int g = 0; g < games; g++) {
        unsigned char len[4];
        if (fread(len, 1, 4, framefile) != 4) die("frame length");
        lengths[g] = len[0] | len[1] << 8 | len[2] << 16 | (uint32_t)len[3] << 24;
        frames[g] = malloc(lengths[g]);
        if (fread(frames[g], 1, lengths[g], framefile) != lengths[g]) die("frame");
    }
    fclose(framefile);

    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) != 0) die("bind");
    if (listen(listener, 4096) != 0) die("listen");
    socklen_t addrlen = sizeof addr;
    getsockname(listener, (struct sockaddr *)&addr, &addrlen);

    int *clients = calloc(sockets, sizeof *clients), *servers = calloc(sockets, sizeof *servers);
    int one = 1;
    for (int i = 0; i < sockets; i++) {
        clients[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (clients[i] < 0) die("socket");
        if (connect(clients[i], (struct sockaddr *)&addr, sizeof addr) != 0) die("connect");
        servers[i] = accept(listener, NULL, NULL);
        if (servers[i] < 0) die("accept");
        /* As our server's transports are: no Nagle, and the same send buffer. */
        setsockopt(servers[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (sndbuf > 0) setsockopt(servers[i], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    }
    close(listener);

    pid_t reader = fork();
    if (reader < 0) die("fork");
    if (reader == 0) {
        for (int i = 0; i < sockets; i++) close(servers[i]);
        pin(argv[7]);
        drain(clients, sockets);
        _exit(0);
    }
    for (int i = 0; i < sockets; i++) close(clients[i]);
    pin(argv[6]);
    signal(SIGPIPE, SIG_IGN);

    long events = 0, frames_sent = 0, bytes = 0, failures = 0;
    double started = now_s(), cpu_before = cpu_s();
    double interval = rate > 0 ? 1.0 / rate : 0.0, next = started;
    for (;;) {
        double t = now_s();
        if (t - started >= seconds) break;
        if (interval > 0) {
            if (t < next) {
                double wait = next - t;
                struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
                nanosleep(&ts, NULL);
                continue;
            }
            next += interval;
        }
        int g = (int)(events % games);
        const char *frame = frames[g];
        uint32_t length = lengths[g];
        const int *who = watchers[g];
        for (int k = 0; k < counts[g]; k++) {
            ssize_t sent = send(servers[who[k]], frame, length, MSG_NOSIGNAL);
            if (sent == (ssize_t)length) {
                frames_sent++;
                bytes += sent;
            } else {
                failures++;
            }
        }
        events++;
    }
    double wall = now_s() - started, cpu = cpu_s() - cpu_before;
    for (int i = 0; i < sockets; i++) close(servers[i]);
    int status;
    waitpid(reader, &status, 0);
    printf("{\"events\":%ld,\"frames\":%ld,\"bytes\":%ld,\"send_failures\":%ld,"
           "\"wall_s\":%.6f,\"cpu_s\":%.6f}\n",
           events, frames_sent, bytes, failures, wall, cpu);
    return 0;
}
