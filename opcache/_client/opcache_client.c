/* opcache's client: a compile served by the user's running `opcache server`,
 * else the same command line run by opcache itself.
 *
 * Built by `opcache masquerade --client DIR` with the machine's C compiler
 * (opcache/server.py, build_client), which defines:
 *   OPCACHE_PROGRAM  the `opcache` program to run when the server does not serve
 *   OPCACHE_TAG      the socket's name: this install and this protocol
 *
 * Run through a link named like a compiler (the masquerade), it stands for
 * `opcache wrap -- <that compiler> ARGS`; run as opcache-client, for
 * `opcache ARGS`.  It sends that command line, the current folder, the umask,
 * the environment and its standard descriptors to the server over a Unix
 * socket in a folder only this user can reach, and gets back what to write on
 * stdout and stderr and the exit status.  On anything else (no server, a
 * miss, a mistake, a reply cut short, a folder or socket that is not this
 * user's own) it runs opcache with the same command line, which then does
 * what it always does; nothing was done yet that it would do twice.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if !defined(OPCACHE_PROGRAM) || !defined(OPCACHE_TAG)
#error "build with -DOPCACHE_PROGRAM=... -DOPCACHE_TAG=... (opcache masquerade --client)"
#endif

#define PROTOCOL "opcache-serve 3"
#define MAX_REPLY (64u << 20)
/* How long a server may take to connect and to take a call (a worker's "taken"
 * byte) before opcache runs itself: a stopped or wedged server (SIGSTOP, a
 * frozen cgroup, a debugger) must not hang the build. */
#define TAKE_MS 2000
#define TAKEN 'T'
/* A worker that has taken a call says it is alive about once a second until its
 * reply; one silent this long (stopped, frozen, wedged) is killed, then opcache
 * runs itself. */
#define ALIVE_MS 10000
#define ALIVE '.'

extern char **environ;

struct buf {
    char *data;
    size_t len, cap;
};

static int put(struct buf *b, const void *data, size_t len) {
    if (b->len + len > b->cap) {
        size_t cap = b->cap ? b->cap : 65536;
        while (cap < b->len + len) cap *= 2;
        char *grown = realloc(b->data, cap);
        if (grown == NULL) return -1;
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, data, len);
    b->len += len;
    return 0;
}

static int put_str(struct buf *b, const char *s) { return put(b, s, strlen(s) + 1); }

/* The command line opcache runs: `opcache wrap -- <compiler> ARGS` or `opcache ARGS`. */
static char **command_line(int argc, char **argv, const char *compiler) {
    char **line = calloc((size_t)argc + 4, sizeof *line);
    if (line == NULL) return NULL;
    int n = 0;
    line[n++] = OPCACHE_PROGRAM;
    if (compiler != NULL) {
        line[n++] = "wrap";
        line[n++] = "--";
        line[n++] = (char *)compiler;
    }
    for (int i = 1; i < argc; i++) line[n++] = argv[i];
    return line;
}

static _Noreturn void run_opcache(char **line) {
    execv(OPCACHE_PROGRAM, line);
    fprintf(stderr, "opcache: error: cannot run %s: %s\n", OPCACHE_PROGRAM, strerror(errno));
    exit(127);
}

/* The path this program was started by, as opcache started through a link
 * sees it: a bare name is the first of that name on PATH that is this program. */
static const char *started_as(const char *name) {
    static char found[PATH_MAX];
    char self[PATH_MAX], real[PATH_MAX];
    const char *path = getenv("PATH");
    if (strchr(name, '/') != NULL || path == NULL || realpath("/proc/self/exe", self) == NULL)
        return name;
    while (*path) {
        size_t len = strcspn(path, ":");
        int n = snprintf(found, sizeof found, "%.*s%s%s", (int)len, len ? path : "",
                         len ? "/" : "", name);
        if (n > 0 && (size_t)n < sizeof found && access(found, X_OK) == 0 &&
            realpath(found, real) != NULL && strcmp(real, self) == 0)
            return found;
        path += len + (path[len] == ':');
    }
    return name;
}

/* The server's folder: $XDG_RUNTIME_DIR/opcache-<uid> (else under /tmp), this
 * user's and no one else's, opened without following a link; -1 if not so. */
static int open_folder(char *path, size_t size) {
    const char *base = getenv("XDG_RUNTIME_DIR");
    if (base == NULL || base[0] != '/') base = "/tmp";
    int n = snprintf(path, size, "%s/opcache-%u", base, (unsigned)getuid());
    if (n < 0 || (size_t)n + sizeof OPCACHE_TAG + 8 >= size) {
        path[0] = '\0';  /* (too long to name a socket in: no server) */
        return -1;
    }
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_uid != getuid() || (st.st_mode & 077) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

/* The variables the server is started with: what its Python's start-up and
 * the server itself read.  Each call brings its own environment; a server
 * keeping the first compile's for minutes would hold its secrets. */
static const char *const SERVER_ENV[] = {
    "PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "LD_LIBRARY_PATH", "XDG_RUNTIME_DIR",
    "OPCACHE_SERVER_IDLE", "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE",
    "PYTHONPLATLIBDIR", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX",
    "PYTHONUTF8", NULL};

/* Start `opcache server` for this socket, detached from this process and its
 * descriptors (a build waiting for a pipe to close must not wait for it), in
 * "/" (not a build folder it would keep busy) with SERVER_ENV only. */
static void start_server(const char *folder) {
    char socket_path[PATH_MAX];
    snprintf(socket_path, sizeof socket_path, "%s/%s.sock", folder, OPCACHE_TAG);
    pid_t child = fork();
    if (child == 0) {
        if (fork() != 0) _exit(0);
        setsid();
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
        }
        long last = sysconf(_SC_OPEN_MAX);
        for (int fd = 3; fd < (last > 0 && last < 65536 ? last : 65536); fd++) close(fd);
        char *env[sizeof SERVER_ENV / sizeof *SERVER_ENV];
        int n = 0;
        for (const char *const *name = SERVER_ENV; *name != NULL; name++) {
            size_t len = strlen(*name);
            for (char **e = environ; *e != NULL; e++) {
                if (strncmp(*e, *name, len) == 0 && (*e)[len] == '=') {
                    env[n++] = *e;  /* (the first of that name, as getenv takes it) */
                    break;
                }
            }
        }
        env[n] = NULL;
        char *argv[] = {OPCACHE_PROGRAM, "server", "--socket", socket_path, NULL};
        if (chdir("/") == 0) execve(OPCACHE_PROGRAM, argv, env);
        _exit(127);
    }
    if (child > 0) waitpid(child, NULL, 0);
}

/* Connect to this user's server: the socket, or -1 (*start: no server to talk to).
 * *server: the server's pid as this process sees it (0: not in its pid namespace). */
static int connect_server(int *start, char *folder, size_t size, pid_t *server) {
    *start = 0;
    int dir = open_folder(folder, size);
    if (dir < 0) {
        struct stat st;
        /* Missing: a server makes it.  There but not ours: left alone, no server. */
        *start = folder[0] != '\0' && lstat(folder, &st) != 0 && errno == ENOENT;
        return -1;
    }
    char name[sizeof OPCACHE_TAG + 8];
    snprintf(name, sizeof name, "%s.sock", OPCACHE_TAG);
    struct stat st;
    if (fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        *start = errno == ENOENT;
        close(dir);
        return -1;
    }
    if (!S_ISSOCK(st.st_mode) || st.st_uid != getuid()) {
        close(dir);
        return -1;
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "/proc/self/fd/%d/%s", dir, name);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    /* Bounds connect (a full backlog: the server takes no calls) and each send. */
    struct timeval limit = {.tv_sec = TAKE_MS / 1000, .tv_usec = TAKE_MS % 1000 * 1000};
    if (sock >= 0 && (setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit) != 0 ||
                      connect(sock, (struct sockaddr *)&addr, sizeof addr) != 0)) {
        *start = errno == ECONNREFUSED;  /* a server that is gone left its socket */
        close(sock);
        sock = -1;
    }
    close(dir);
    struct ucred peer;
    socklen_t len = sizeof peer;
    if (sock >= 0 && (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0 ||
                      peer.uid != getuid())) {
        close(sock);
        sock = -1;
    }
    *server = sock >= 0 ? peer.pid : 0;
    return sock;
}

/* Whether a worker took the call: its "taken" byte and its pid within TAKE_MS
 * (its pid, else 0).  Until then a worker has done nothing: the request is sent
 * only after, so a worker that takes the call once this client gave up finds no
 * request, and never writes outputs opcache is writing too. */
static pid_t taken(int sock) {
    unsigned char word[1 + sizeof(int32_t)];
    size_t got = 0;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left = TAKE_MS - (now.tv_sec - start.tv_sec) * 1000 -
                    (now.tv_nsec - start.tv_nsec) / 1000000;
        struct pollfd p = {.fd = sock, .events = POLLIN};
        int ready = poll(&p, 1, left > 0 ? (int)left : 0);
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) return 0;
        ssize_t n = read(sock, word + got, sizeof word - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;
        got += (size_t)n;
        if (got == sizeof word) {
            int32_t pid;
            memcpy(&pid, word + 1, sizeof pid);
            return word[0] == TAKEN && pid > 0 ? pid : 0;
        }
    }
}

/* The worker that took the call, held by a pidfd (a pid reused cannot be hit):
 * the descriptor, or -1 when it cannot be told for sure (no pidfd, another pid
 * namespace, a pid that is not the server's child). */
static int hold_worker(pid_t worker, pid_t server) {
    if (worker <= 0 || server <= 0) return -1;
    int fd = (int)syscall(SYS_pidfd_open, worker, 0);
    if (fd < 0) return -1;
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)worker);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = f >= 0 ? read(f, stat, sizeof stat - 1) : -1;
    if (f >= 0) close(f);
    stat[n > 0 ? n : 0] = '\0';
    const char *end = strrchr(stat, ')');  /* (the name may hold anything) */
    int parent = 0;
    if (end == NULL || sscanf(end + 1, " %*c %d", &parent) != 1 || parent != server) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Kill the worker and wait until it is gone: no late write of its can land on
 * the outputs opcache writes next. */
static void end_worker(int pidfd) {
    syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0);
    struct pollfd p = {.fd = pidfd, .events = POLLIN};
    while (poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
}

static int send_request(int sock, char **line, const char *cwd) {
    struct buf b = {0};
    char number[32];
    mode_t mask = umask(0);
    umask(mask);
    int argc = 0;
    while (line[argc] != NULL) argc++;
    int bad = put_str(&b, PROTOCOL);
    snprintf(number, sizeof number, "%o", (unsigned)mask);
    bad |= put_str(&b, number) | put_str(&b, cwd);
    snprintf(number, sizeof number, "%d", argc);
    bad |= put_str(&b, number);
    for (int i = 0; i < argc; i++) bad |= put_str(&b, line[i]);
    for (char **e = environ; *e != NULL; e++) bad |= put_str(&b, *e);
    if (bad || b.len > UINT32_MAX) return -1;
    uint32_t size = (uint32_t)b.len;
    /* The length, with this process's stdin, stdout and stderr attached. */
    int fds[3] = {0, 1, 2};
    char control[CMSG_SPACE(sizeof fds)] = {0};
    struct iovec iov = {.iov_base = &size, .iov_len = sizeof size};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    if (sendmsg(sock, &msg, MSG_NOSIGNAL) != (ssize_t)sizeof size) return -1;
    for (size_t done = 0; done < b.len;) {
        ssize_t n = send(sock, b.data + done, b.len - done, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        done += (size_t)n;
    }
    free(b.data);
    return 0;
}

/* The whole reply, up to the server closing the connection, without the
 * worker's "alive" bytes before it.  A worker silent for ALIVE_MS is ended
 * first (-1); one not held (pidfd -1) is waited for without a limit. */
static int read_reply(int sock, struct buf *reply, int pidfd) {
    char chunk[65536];
    for (;;) {
        struct pollfd p = {.fd = sock, .events = POLLIN};
        int ready = poll(&p, 1, pidfd >= 0 ? ALIVE_MS : -1);
        if (ready < 0 && errno == EINTR) continue;
        if (ready == 0) {
            end_worker(pidfd);
            return -1;
        }
        ssize_t n = ready < 0 ? -1 : read(sock, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        if (n == 0) return 0;
        size_t skip = 0;
        while (reply->len == 0 && skip < (size_t)n && chunk[skip] == ALIVE) skip++;
        if (reply->len + (size_t)n - skip > MAX_REPLY || put(reply, chunk + skip, (size_t)n - skip) != 0)
            return -1;
    }
}

static void write_all(int fd, const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        data += n;
        len -= (size_t)n;
    }
}

/* A served reply: "S", the exit status, then (stream, length, bytes) records and
 * an end record (stream 0).  Anything else, or a reply cut short: -1. */
static int replay(const struct buf *r) {
    int32_t status;
    uint32_t len;
    size_t at = 1 + sizeof status;
    if (r->len < at || r->data[0] != 'S') return -1;
    memcpy(&status, r->data + 1, sizeof status);
    for (size_t scan = at;;) {  /* checked whole before a byte is written */
        if (r->len < scan + 1 + sizeof len) return -1;
        memcpy(&len, r->data + scan + 1, sizeof len);
        if (r->data[scan] == 0) break;
        if ((r->data[scan] != 1 && r->data[scan] != 2) || r->len - scan - 1 - sizeof len < len)
            return -1;
        scan += 1 + sizeof len + len;
    }
    while (r->data[at] != 0) {
        memcpy(&len, r->data + at + 1, sizeof len);
        write_all(r->data[at], r->data + at + 1 + sizeof len, len);
        at += 1 + sizeof len + len;
    }
    return status & 0xff;
}

int main(int argc, char **argv) {
    const char *name = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    int masquerade = strcmp(name, "opcache-client") != 0;
    char **line = command_line(argc, argv, masquerade ? started_as(argv[0]) : NULL);
    if (line == NULL) return 127;
    char cwd[PATH_MAX], folder[PATH_MAX];
    int served = masquerade || (argc > 1 && strcmp(argv[1], "wrap") == 0);
    for (int fd = 0; fd < 3; fd++) served = served && fcntl(fd, F_GETFD) >= 0;
    if (!served || getcwd(cwd, sizeof cwd) == NULL) run_opcache(line);
    int start;
    pid_t server;
    int sock = connect_server(&start, folder, sizeof folder, &server);
    if (sock < 0) {
        if (start) start_server(folder);
        run_opcache(line);
    }
    struct buf reply = {0};
    pid_t worker = taken(sock);
    int pidfd = hold_worker(worker, server);
    if (worker > 0 && send_request(sock, line, cwd) == 0 && read_reply(sock, &reply, pidfd) == 0) {
        int status = replay(&reply);
        if (status >= 0) return status;
    }
    run_opcache(line);
}
