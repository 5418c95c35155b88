/* opcache's client: a compile served by the user's running `opcache server`,
 * else the same command line run by opcache itself.
 *
 * Built by `opcache masquerade --client DIR` with the machine's C compiler
 * (opcache/server.py, build_client), which defines:
 *   OPCACHE_PROGRAM  the `opcache` program to run when the server does not serve
 *   OPCACHE_TAG      this install and this protocol: its socket's name begins with it
 *   OPCACHE_UNKEYED  the variables a memo's name leaves out, each ending in \0
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
 *
 * First, though, it tries its own memo of the command (serve_memo, below): a
 * hit a server's worker served or stored leaves one, and while every path it
 * records is as it was, the client serves the hit alone.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if !defined(OPCACHE_PROGRAM) || !defined(OPCACHE_TAG) || !defined(OPCACHE_UNKEYED)
#error "build with -DOPCACHE_PROGRAM=... -DOPCACHE_TAG=... -DOPCACHE_UNKEYED=... (opcache masquerade --client)"
#endif

#define PROTOCOL "opcache-serve 4"
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
    if (len == 0) return 0; /* (memcpy takes no null pointer, even for no bytes) */
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

/* The variables the server is started with: what its Python's start-up and
 * the server itself read.  Each call brings its own environment; a server
 * keeping the first compile's for minutes would hold its secrets. */
static const char *const SERVER_ENV[] = {
    "PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "LD_LIBRARY_PATH", "XDG_RUNTIME_DIR",
    "OPCACHE_SERVER_IDLE", "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE",
    "PYTHONPLATLIBDIR", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX",
    "PYTHONUTF8", NULL};

#define NAME_SIZE (sizeof OPCACHE_TAG + 24) /* <tag>-<16 hex>.sock and its NUL */

static uint64_t xxh64(const void *data, size_t len, uint64_t seed);

/* The socket's name (server.socket_name): the tag, then the XXH64 of the start-up
 * environment (HOME and the PYTHON* names of SERVER_ENV: server.STARTUP_ENVIRONMENT),
 * each "NAME=value", or "NAME" when unset, ending in a NUL.  Each set of values has
 * a server of its own, started with them: one started with another HOME would load
 * another opcache, and serves no call of this one.  0, or -1 (no memory). */
static int socket_name(char *name) {
    struct buf b = {0};
    int bad = 0;
    for (const char *const *n = SERVER_ENV; *n != NULL; n++) {
        if (strcmp(*n, "HOME") != 0 && strncmp(*n, "PYTHON", 6) != 0) continue;
        const char *value = getenv(*n); /* (the first of that name, as the server's) */
        bad |= put(&b, *n, strlen(*n));
        if (value != NULL) bad |= put(&b, "=", 1) | put(&b, value, strlen(value));
        bad |= put(&b, "", 1);
    }
    if (!bad)
        snprintf(name, NAME_SIZE, "%s-%016llx.sock", OPCACHE_TAG,
                 (unsigned long long)xxh64(b.data, b.len, 0));
    free(b.data);
    return bad ? -1 : 0;
}

/* The server's folder: $XDG_RUNTIME_DIR/opcache-<uid> (else under /tmp), this
 * user's and no one else's, opened without following a link; -1 if not so. */
static int open_folder(char *path, size_t size) {
    const char *base = getenv("XDG_RUNTIME_DIR");
    if (base == NULL || base[0] != '/') base = "/tmp";
    int n = snprintf(path, size, "%s/opcache-%u", base, (unsigned)getuid());
    if (n < 0 || (size_t)n + NAME_SIZE >= size) {
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

/* Start `opcache server` for this socket, detached from this process and its
 * descriptors (a build waiting for a pipe to close must not wait for it), in
 * "/" (not a build folder it would keep busy) with SERVER_ENV only. */
static void start_server(const char *folder, const char *name) {
    char socket_path[PATH_MAX];
    snprintf(socket_path, sizeof socket_path, "%s/%s", folder, name);
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

/* Each start-up environment has a server of its own: a build that gives each
 * compile another HOME would start one per compile, each living minutes.  Past
 * this many up, a call with no server of its own takes opcache's own path. */
#define MAX_SERVERS 4

/* How many of this user's servers are up (at most MAX_SERVERS): the lock files
 * of the folder open as dir that a server holds. */
static int servers_up(int dir) {
    int fd = openat(dir, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *listing = fd < 0 ? NULL : fdopendir(fd);
    if (listing == NULL) {
        if (fd >= 0) close(fd);
        return MAX_SERVERS;
    }
    int up = 0;
    struct dirent *e;
    while (up < MAX_SERVERS && (e = readdir(listing)) != NULL) {
        size_t n = strlen(e->d_name);
        if (n <= 5 || strcmp(e->d_name + n - 5, ".lock") != 0) continue;
        int lock = openat(dir, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (lock < 0) continue;
        struct stat st;
        /* (held: a server's; a lock free for a moment's shared try is no one's) */
        if (fstat(lock, &st) == 0 && S_ISREG(st.st_mode) && flock(lock, LOCK_SH | LOCK_NB) != 0 &&
            errno == EWOULDBLOCK)
            up++;
        close(lock);
    }
    closedir(listing);
    return up;
}

/* Whether the folder holding ``folder`` (its path up to the last '/') is there. */
static int base_exists(const char *folder) {
    char base[PATH_MAX];
    const char *slash = strrchr(folder, '/');
    struct stat st;
    if (slash == NULL || (size_t)(slash - folder) >= sizeof base) return 0;
    memcpy(base, folder, (size_t)(slash - folder));
    base[slash - folder] = '\0';
    return base[0] == '\0' || (stat(base, &st) == 0 && S_ISDIR(st.st_mode));
}

/* Connect to this user's server of this start-up environment (name: its socket's):
 * the socket, or -1 (*start: no server to talk to).
 * *server: the server's pid as this process sees it (0: not in its pid namespace). */
static int connect_server(int *start, char *folder, size_t size, const char *name,
                          pid_t *server) {
    *start = 0;
    int dir = open_folder(folder, size);
    if (dir < 0) {
        struct stat st;
        /* Missing: a server makes it, in a base folder that is there (XDG_RUNTIME_DIR
         * may name one gone, after su or a logout: a server could not start).  There
         * but not ours: left alone, no server. */
        *start = folder[0] != '\0' && lstat(folder, &st) != 0 && errno == ENOENT &&
                 base_exists(folder);
        return -1;
    }
    struct stat st;
    if (fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        *start = errno == ENOENT && servers_up(dir) < MAX_SERVERS;
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
        /* a server that is gone left its socket */
        *start = errno == ECONNREFUSED && servers_up(dir) < MAX_SERVERS;
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

/* The call: "1" when this client wants its memo of it (it found none that holds), the
 * umask, the folder, the command line and the environment; stdin, stdout, stderr. */
static int send_request(int sock, char **line, const char *cwd, int wants_memo) {
    struct buf b = {0};
    char number[32];
    mode_t mask = umask(0);
    umask(mask);
    int argc = 0;
    while (line[argc] != NULL) argc++;
    int bad = put_str(&b, PROTOCOL) | put_str(&b, wants_memo ? "1" : "0");
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

static int write_all(int fd, const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        data += n;
        len -= (size_t)n;
    }
    return 0;
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
    /* A reader that left (of the streams, or of an error line): 1, as the Python path's,
     * not a death by SIGPIPE. */
    signal(SIGPIPE, SIG_IGN);
    while (r->data[at] != 0) {
        memcpy(&len, r->data + at + 1, sizeof len);
        if (write_all(r->data[at], r->data + at + 1 + sizeof len, len) != 0) {
            if (errno != EPIPE) fprintf(stderr, "opcache: error: %s\n", strerror(errno));
            return 1;
        }
        at += 1 + sizeof len + len;
    }
    return status & 0xff;
}

/* -- the client's memo: a hit served here, without the server ---------------------
 *
 * A served hit (or a full hit in a worker) leaves, beside the Python memo
 * (opcache/quickhit.py), one for this client (quickmemo.client_memo): the same
 * records, with each artifact's xxh64.  The next identical call checks it here
 * exactly as quickhit.Memo.serve checks its own, in the same order and with the
 * same rules; anything unknown, malformed or not as recorded, or an output it
 * cannot put in place: not served (nothing counted), and the call goes to the
 * server as before.  Once the hit is delivered and counted, an error replaying
 * ends the run as the Python path's would: "opcache: error: ...", 1. */

#define MEMO_FORMAT "opcache-client 8" /* quickhit.CLIENT_FORMAT */
#define MEMO_FOLDER "quick"            /* quickhit.FOLDER */
#define MAX_MEMO (1u << 20)            /* quickhit.MAX_MEMO */
#define NO_SIZE "-1"                   /* quickhit.NO_SIZE: a folder not listed */
#define READ_FLAGS (O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
#define FOLDER_FLAGS (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

/* XXH64 (the xxHash specification's; Python's xxhash.xxh64 gives the same). */
static const uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL,
                      P3 = 1609587929392839161ULL, P4 = 9650029242287828579ULL,
                      P5 = 2870177450012600261ULL;

static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t read64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i]; /* little-endian, any alignment */
    return v;
}

static uint32_t read32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t xxh_round(uint64_t acc, uint64_t input) {
    return rotl(acc + input * P2, 31) * P1;
}

static uint64_t xxh_merge(uint64_t acc, uint64_t value) {
    return (acc ^ xxh_round(0, value)) * P1 + P4;
}

static uint64_t xxh64(const void *data, size_t len, uint64_t seed) {
    const unsigned char *p = data, *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        for (; end - p >= 32; p += 32) {
            v1 = xxh_round(v1, read64(p));
            v2 = xxh_round(v2, read64(p + 8));
            v3 = xxh_round(v3, read64(p + 16));
            v4 = xxh_round(v4, read64(p + 24));
        }
        h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
        h = xxh_merge(xxh_merge(xxh_merge(xxh_merge(h, v1), v2), v3), v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    for (; end - p >= 8; p += 8) h = rotl(h ^ xxh_round(0, read64(p)), 27) * P1 + P4;
    if (end - p >= 4) {
        h = rotl(h ^ (uint64_t)read32(p) * P1, 23) * P2 + P3;
        p += 4;
    }
    for (; p < end; p++) h = rotl(h ^ *p * P5, 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    return h ^ (h >> 32);
}

static int by_bytes(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b); /* (unsigned, as bytes sort) */
}

static int by_number(const void *a, const void *b) {
    gid_t x = *(const gid_t *)a, y = *(const gid_t *)b;
    return (x > y) - (x < y);
}

static int unkeyed(const char *entry, size_t len) {
    for (const char *name = OPCACHE_UNKEYED; *name; name += strlen(name) + 1)
        if (strlen(name) == len && memcmp(entry, name, len) == 0) return 1;
    return 0;
}

/* This process's effective capabilities as /proc/self/status writes them (into out),
 * as quickhit.capabilities reads them: root without CAP_DAC_OVERRIDE may not read
 * what root may.  0, or -1 when they cannot be read. */
static int capabilities(char *out, size_t size) {
    int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    struct buf b = {0};
    char chunk[4096];
    ssize_t n;
    int bad = 0;
    while (!bad && (n = read(fd, chunk, sizeof chunk)) > 0) bad = put(&b, chunk, (size_t)n);
    close(fd);
    bad |= n < 0 || put(&b, "", 1);
    const char *at = bad ? NULL : strstr(b.data, "\nCapEff:");
    if (at != NULL) {
        at += strlen("\nCapEff:");
        at += strspn(at, " \t");
        size_t len = strcspn(at, " \t\n");
        if (len < size) {
            memcpy(out, at, len);
            out[len] = '\0';
        } else {
            at = NULL;
        }
    }
    free(b.data);
    return at == NULL ? -1 : 0;
}

/* The memo's name, as quickhit.client_memo_name makes it (into name[34]): 0, or -1
 * when this process's environment is not one the server would have named alike (a
 * variable given twice, an entry without a name). */
static int memo_name(char **line, const char *cwd, char *name) {
    struct buf b = {0};
    char text[PATH_MAX], ns[128];
    int bad = 0;
    ssize_t n = readlink("/proc/self/ns/mnt", ns, sizeof ns - 1);
    if (n <= 0) return -1;
    ns[n] = '\0';
    mode_t mask = umask(0);
    umask(mask);
    bad |= put_str(&b, MEMO_FORMAT) | put_str(&b, OPCACHE_TAG) | put_str(&b, ns);
    bad |= put_str(&b, cwd);
    snprintf(text, sizeof text, "%o %u %u", (unsigned)mask, (unsigned)getuid(),
             (unsigned)getgid());
    bad |= put_str(&b, text);
    int count = getgroups(0, NULL);
    gid_t *groups = count >= 0 ? calloc((size_t)count + 1, sizeof *groups) : NULL;
    if (groups == NULL || (count = getgroups(count, groups)) < 0) {
        free(groups);
        free(b.data);
        return -1;
    }
    qsort(groups, (size_t)count, sizeof *groups, by_number);
    for (int i = 0; i < count; i++) {
        snprintf(text, sizeof text, i ? " %u" : "%u", (unsigned)groups[i]);
        bad |= put(&b, text, strlen(text));
    }
    free(groups);
    bad |= put(&b, "", 1);
    struct utsname uts;
    bad |= uname(&uts) != 0 || put_str(&b, uts.nodename);
    bad |= capabilities(text, sizeof text) != 0 || put_str(&b, text);
    int argc = 0;
    while (line[argc] != NULL) argc++;
    snprintf(text, sizeof text, "%d", argc);
    bad |= put_str(&b, text);
    for (int i = 0; i < argc; i++) bad |= put_str(&b, line[i]);
    size_t vars = 0;
    while (environ[vars] != NULL) vars++;
    char **env = calloc(vars + 1, sizeof *env);
    size_t kept = 0;
    for (size_t i = 0; env != NULL && i < vars; i++) {
        const char *eq = strchr(environ[i], '=');
        if (eq == NULL || eq == environ[i]) bad = 1; /* (the server leaves it out) */
        else if (!unkeyed(environ[i], (size_t)(eq - environ[i]))) env[kept++] = environ[i];
    }
    if (env != NULL) qsort(env, kept, sizeof *env, by_bytes);
    for (size_t i = 0; env != NULL && i < kept; i++) {
        size_t len = strcspn(env[i], "=") + 1;
        if (i > 0 && strncmp(env[i - 1], env[i], len) == 0) bad = 1; /* given twice */
        bad |= put_str(&b, env[i]);
    }
    free(env);
    if (bad || env == NULL) {
        free(b.data);
        return -1;
    }
    /* (the fields joined by NULs: without the last one's) */
    snprintf(name, 34, "c%016llx%016llx", (unsigned long long)xxh64(b.data, b.len - 1, 0),
             (unsigned long long)xxh64(b.data, b.len - 1, 1));
    free(b.data);
    return 0;
}

/* A memo's field that is a number as Python's "%d" writes it: its value, or -1. */
static long long number(const char *text) {
    long long value = 0;
    if (text[0] == '\0' || (text[0] == '0' && text[1] != '\0')) return -1;
    for (const char *c = text; *c; c++) {
        if (*c < '0' || *c > '9' || value > (LLONG_MAX - 9) / 10) return -1;
        value = value * 10 + (*c - '0');
    }
    return value;
}

/* Whether a path's identity now is the 7 fields recorded (quickhit.identity's). */
static int same_identity(const char *path, int follow, char **want) {
    struct stat st;
    char got[7][32];
    if ((follow ? stat(path, &st) : lstat(path, &st)) != 0) {
        snprintf(got[0], sizeof got[0], "%d", -(errno ? errno : 1));
        for (int i = 1; i < 7; i++) strcpy(got[i], "0");
    } else {
        snprintf(got[0], sizeof got[0], "%llu", (unsigned long long)st.st_dev);
        snprintf(got[1], sizeof got[1], "%llu", (unsigned long long)st.st_ino);
        snprintf(got[2], sizeof got[2], "%u", (unsigned)st.st_mode);
        snprintf(got[3], sizeof got[3], "%u", (unsigned)st.st_uid);
        if (strcmp(want[4], NO_SIZE) == 0 && S_ISDIR(st.st_mode)) {
            strcpy(got[4], NO_SIZE);
            strcpy(got[5], "0");
            strcpy(got[6], "0");
        } else {
            snprintf(got[4], sizeof got[4], "%lld", (long long)st.st_size);
            snprintf(got[5], sizeof got[5], "%lld",
                     (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
            snprintf(got[6], sizeof got[6], "%lld",
                     (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec);
        }
    }
    for (int i = 0; i < 7; i++)
        if (strcmp(got[i], want[i]) != 0) return 0;
    return 1;
}

/* The folder at path if it is still the one recorded (its device and inode): -1 if not. */
static int open_same(const char *path, const char *dev, const char *ino) {
    int fd = open(path, FOLDER_FLAGS);
    struct stat st;
    char d[32], i[32];
    if (fd < 0) return -1;
    if (fstat(fd, &st) == 0) {
        snprintf(d, sizeof d, "%llu", (unsigned long long)st.st_dev);
        snprintf(i, sizeof i, "%llu", (unsigned long long)st.st_ino);
        if (strcmp(d, dev) == 0 && strcmp(i, ino) == 0) return fd;
    }
    close(fd);
    return -1;
}

/* Read a whole file (at most max bytes, else -1) from fd; its bytes and size. */
static int read_whole(int fd, size_t max, char **data, size_t *size) {
    struct buf b = {0};
    char chunk[65536];
    for (;;) {
        ssize_t n = read(fd, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 || b.len + (size_t)n > max || put(&b, chunk, (size_t)n) != 0) {
            free(b.data);
            return -1;
        }
        if (n == 0) break;
    }
    /* An empty file: a buffer all the same (xxh64 and memmem take no null pointer). */
    *data = b.data != NULL ? b.data : malloc(1);
    *size = b.len;
    return *data != NULL ? 0 : -1;
}

struct artifact {
    /* its record's fields after the tag: target (or stream), name, size, xxh64, and for
     * an output the device and inode of its folder */
    char **at;
    char *data;
    size_t len;
    int folder;       /* an output's: its folder (open_place), or -1 */
    const char *name; /* its name there */
    char temp[64];    /* the new file made there (deliver) */
};

/* The artifact of a record, read from the entry: regular, the size and xxh64 recorded. */
static int read_artifact(int entry, struct artifact *a) {
    long long size = number(a->at[2]);
    char digest[17];
    int fd = size < 0 ? -1 : openat(entry, a->at[1], READ_FLAGS);
    struct stat st;
    if (fd < 0) return -1;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == size &&
             read_whole(fd, (size_t)size, &a->data, &a->len) == 0 && a->len == (size_t)size;
    close(fd);
    if (!ok) return -1;
    snprintf(digest, sizeof digest, "%016llx", (unsigned long long)xxh64(a->data, a->len, 0));
    return strcmp(digest, a->at[3]) == 0 ? 0 : -1;
}

/* The hit's count: one line appended to the chip's counts (quickhit.Memo._count). */
static int count(char **n) {
    long long mode = number(n[3]);
    int folder = mode < 0 || mode > 07777 ? -1 : open_same(n[0], n[1], n[2]);
    if (folder < 0) return -1;
    int flags = O_WRONLY | O_APPEND | READ_FLAGS, made = 0;
    int fd = openat(folder, n[4], flags);
    if (fd < 0 && errno == ENOENT) {
        /* Made here, so its mode is set here: never another file's (a hard link). */
        fd = openat(folder, n[4], flags | O_CREAT | O_EXCL, 0600);
        made = 1;
    }
    close(folder);
    if (fd < 0) return -1;
    struct stat st;
    size_t len = strlen(n[5]);
    /* One link, and shared with a fold (CounterFiles takes it exclusively). */
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
             st.st_size < (off_t)MAX_MEMO && flock(fd, LOCK_SH | LOCK_NB) == 0 &&
             fstat(fd, &st) == 0 && st.st_nlink == 1 &&
             (!made || (long long)(st.st_mode & 07777) == mode || fchmod(fd, (mode_t)mode) == 0) &&
             write(fd, n[5], len) == (ssize_t)len;
    close(fd);
    return ok ? 0 : -1;
}

/* The entry's access, as a full hit stamps it (aging must see the use); a hint only. */
static void stamp(int entry, const char *manifest, double every) {
    struct timespec now;
    struct stat st;
    if (every < 0 || clock_gettime(CLOCK_REALTIME, &now) != 0 ||
        fstatat(entry, manifest, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return;
    double age = (double)(now.tv_sec - st.st_mtim.tv_sec) +
                 (double)(now.tv_nsec - st.st_mtim.tv_nsec) / 1e9;
    if (age < every) return;
    struct timespec times[2] = {now, now};
    if (utimensat(entry, manifest, times, AT_SYMLINK_NOFOLLOW) != 0 && errno == EPERM)
        utimensat(entry, manifest, NULL, AT_SYMLINK_NOFOLLOW); /* (another's entry) */
}

static _Noreturn void fail(void) {
    fprintf(stderr, "opcache: error: %s\n", strerror(errno));
    exit(1);
}

/* quickhit._unreplaceable_in's: another user's file (``st``: its lstat), though the
 * compiler may write into it, in a sticky folder (as /tmp) that is not ours either. */
static int unreplaceable(const struct stat *folder, const struct stat *st) {
    if (st->st_uid == geteuid() || geteuid() == 0) return 0;
    return (folder->st_mode & S_ISVTX) && folder->st_uid != geteuid();
}

/* quickhit._open_place's: the output's folder, reached as the compiler reaches it
 * (links followed) and opened once (O_PATH: one this user may write in but not list
 * too), if it is still the folder the full hit wrote into (its device and inode), and
 * the target there missing or a regular file this user may rename over: 0, else -1
 * (not served: the folder gone or moved, or the full path's work). */
static int open_place(struct artifact *a) {
    const char *target = a->at[0], *slash = strrchr(target, '/');
    char folder[PATH_MAX], d[32], i[32];
    struct stat in, st;
    if (slash == NULL || (size_t)(slash - target) >= sizeof folder) return -1;
    snprintf(folder, sizeof folder, "%.*s", (int)(slash == target ? 1 : slash - target), target);
    a->name = slash + 1;
    a->folder = open(folder, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (a->folder < 0 || fstat(a->folder, &in) != 0) return -1;
    snprintf(d, sizeof d, "%llu", (unsigned long long)in.st_dev);
    snprintf(i, sizeof i, "%llu", (unsigned long long)in.st_ino);
    if (strcmp(d, a->at[4]) != 0 || strcmp(i, a->at[5]) != 0) return -1;
    if (fstatat(a->folder, a->name, &st, AT_SYMLINK_NOFOLLOW) != 0) return errno == ENOENT ? 0 : -1;
    return S_ISREG(st.st_mode) && !unreplaceable(&in, &st) ? 0 : -1;
}

/* quickhit._deliver's: each output as the full path writes it, a new file (0666 less
 * the umask) in its folder renamed over the target; then the hit is counted.  Every
 * output is written in full before any is renamed, so one that cannot be made (a
 * folder not writable, a read-only file system, a full disk) replaces none.  Any
 * error: every temporary file removed, nothing counted, -1 (not served: opcache
 * then runs the command, which writes every output itself, those renamed already
 * too).  A Ctrl-C waits until the outputs are in place and counted, or none is
 * half made. */
static int deliver(struct artifact *outputs, size_t count_of, char **counts) {
    /* Past a file size limit (ulimit -f) a write fails (EFBIG: not served, the command
     * runs and meets the limit itself), rather than killing the client half way. */
    signal(SIGXFSZ, SIG_IGN);
    sigset_t block, held;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &held);
    size_t made = 0, renamed = 0;
    int ok = 1;
    for (; ok && made < count_of; made++) {
        struct artifact *a = &outputs[made];
        int fd = -1;
        /* The name needs no secret (O_EXCL|O_NOFOLLOW make it safe), and no getrandom
         * (a seccomp list, an old kernel): pid, clock and a number, another on a name
         * taken. */
        for (uint32_t tries = 0; fd < 0 && tries < 1000; tries++) {
            struct timespec now = {0};
            clock_gettime(CLOCK_MONOTONIC, &now);
            snprintf(a->temp, sizeof a->temp, ".opcache-wrap.%d.%08x", (int)getpid(),
                     (uint32_t)now.tv_nsec ^ (uint32_t)(made + tries * 0x9e3779b9u));
            fd = openat(a->folder, a->temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                        0666);
            if (fd < 0 && errno != EEXIST) break;
        }
        if (fd < 0) {
            ok = 0;
            break;
        }
        ok = write_all(fd, a->data, a->len) == 0;
        ok = close(fd) == 0 && ok; /* (NFS reports a full disk at close) */
    }
    while (ok && renamed < count_of) {
        struct artifact *a = &outputs[renamed];
        ok = renameat(a->folder, a->temp, a->folder, a->name) == 0;
        renamed += ok;
    }
    if (!ok)
        for (size_t i = renamed; i < made; i++) unlinkat(outputs[i].folder, outputs[i].temp, 0);
    if (ok) ok = count(counts) == 0;
    sigprocmask(SIG_SETMASK, &held, NULL);
    return ok ? 0 : -1;
}

/* The memo's hit, served here (exits), if the memo holds; else returns (nothing done). */
static void serve_memo(const char *name) {
    char path[PATH_MAX], *raw = NULL;
    size_t size = 0;
    int folder = open_folder(path, sizeof path), quick = -1, fd = -1;
    struct stat st;
    if (folder >= 0) {
        quick = openat(folder, MEMO_FOLDER, FOLDER_FLAGS);
        close(folder);
    }
    if (quick < 0) return;
    if (fstat(quick, &st) == 0 && st.st_uid == getuid() && (st.st_mode & 077) == 0)
        fd = openat(quick, name, READ_FLAGS);
    close(quick);
    if (fd < 0) return;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == getuid() &&
             st.st_size <= (off_t)MAX_MEMO && read_whole(fd, MAX_MEMO, &raw, &size) == 0;
    close(fd);
    if (!ok) return;
    time_t written = st.st_mtim.tv_sec;
    /* Its fields, split at the NULs (a memo holds no other NUL). */
    size_t n = 1;
    for (size_t i = 0; i < size; i++) n += raw[i] == '\0';
    char **f = calloc(n + 1, sizeof *f), *text = malloc(size + 1);
    if (f == NULL || text == NULL) return;
    memcpy(text, raw, size);
    text[size] = '\0';
    free(raw);
    f[0] = text;
    for (size_t i = 0, k = 1; i < size; i++)
        if (text[i] == '\0') f[k++] = text + i + 1;
    if (strcmp(f[0], MEMO_FORMAT) != 0 || strcmp(f[n - 1], "end") != 0) return;
    /* The records: checks (c), the entry (e), outputs (o), streams (s), counts (n). */
    struct artifact *outputs = calloc(n, sizeof *outputs), *streams = calloc(n, sizeof *streams);
    char ***checks = calloc(n, sizeof *checks), **entry = NULL, **counts = NULL;
    size_t nc = 0, no = 0, ns = 0, end = n - 1;
    if (outputs == NULL || streams == NULL || checks == NULL) return;
    for (size_t at = 1; at < end;) {
        const char *tag = f[at];
        size_t width = strcmp(tag, "c") == 0   ? 10
                       : strcmp(tag, "e") == 0 ? 6
                       : strcmp(tag, "o") == 0 ? 7
                       : strcmp(tag, "s") == 0 ? 5
                       : strcmp(tag, "n") == 0 ? 7
                                                : 0;
        if (width == 0 || at + width > end) return;
        char **rest = f + at + 1;
        if (tag[0] == 'c') {
            if (strcmp(rest[1], "0") != 0 && strcmp(rest[1], "1") != 0) return;
            checks[nc++] = rest;
        } else if (tag[0] == 'e') {
            if (entry != NULL) return;
            entry = rest;
        } else if (tag[0] == 'o') {
            if (rest[0][0] != '/') return;
            outputs[no++].at = rest;
        } else if (tag[0] == 's') {
            if (strcmp(rest[0], "1") != 0 && strcmp(rest[0], "2") != 0) return;
            streams[ns++].at = rest;
        } else {
            if (counts != NULL) return;
            counts = rest;
        }
        at += width;
    }
    char *stop;
    double every = entry != NULL ? strtod(entry[4], &stop) : 0;
    if (no == 0 || entry == NULL || counts == NULL || *entry[4] == '\0' || *stop != '\0') return;
    for (size_t i = 0; i < no; i++) outputs[i].folder = -1; /* (none open yet) */
    /* Everything that can be checked first, as quickhit.Memo.serve. */
    for (size_t i = 0; i < nc; i++)
        if (!same_identity(checks[i][0], checks[i][1][0] == '1', checks[i] + 2)) return;
    int folder_fd = open_same(entry[0], entry[1], entry[2]);
    if (folder_fd < 0) return;
    for (size_t i = 0; i < no; i++)
        if (read_artifact(folder_fd, &outputs[i]) != 0) goto miss;
    for (size_t i = 0; i < ns; i++)
        if (read_artifact(folder_fd, &streams[i]) != 0 ||
            memmem(streams[i].data, streams[i].len, "\x1b[", 2) != NULL)
            goto miss; /* (colour taken out where it cannot show: the full path's work) */
    /* Each output's folder, still the one the full hit wrote into; each target missing
     * or a regular file this user may rename over (else the full path's work). */
    for (size_t i = 0; i < no; i++)
        if (open_place(&outputs[i]) != 0) goto miss;
    /* Put in place, then counted: not served (nothing counted) if any cannot be. */
    if (deliver(outputs, no, counts) != 0) goto miss;
    /* Delivered and counted: from here on the run ends here, whatever fails (the full
     * path's status).  A reader that left (of the streams, or of an error line): 1, as
     * the Python path's. */
    signal(SIGPIPE, SIG_IGN);
    stamp(folder_fd, entry[3], every);
    /* A memo served here is never rewritten by a server: renewed a day at a time, it is
     * not cleaned as unused (quickmemo.MEMO_DAYS) while in use.  A hint, as the stamp. */
    if (time(NULL) - written > 86400 &&
        (size_t)snprintf(path + strlen(path), sizeof path - strlen(path), "/%s/%s",
                         MEMO_FOLDER, name) < sizeof path - strlen(path))
        utimensat(AT_FDCWD, path, NULL, AT_SYMLINK_NOFOLLOW);
    for (int stream = 1; stream <= 2; stream++) {
        for (size_t i = 0; i < ns; i++) {
            const char *data = streams[i].data;
            size_t left = streams[i].len;
            if (streams[i].at[0][0] - '0' != stream) continue;
            while (left > 0) {
                ssize_t w = write(stream, data, left);
                if (w < 0 && errno == EINTR) continue;
                if (w < 0 && errno == EPIPE) exit(1);
                if (w <= 0) fail();
                data += w;
                left -= (size_t)w;
            }
        }
    }
    exit(0);
miss:
    for (size_t i = 0; i < no; i++)
        if (outputs[i].folder >= 0) close(outputs[i].folder);
    close(folder_fd);
}

/* A Ctrl-C (or SIGTERM, SIGHUP, SIGQUIT) while a worker serves the call: the client
 * tells it (its end of the connection shut for writing: the worker renames nothing
 * more) and ends by that signal only once the worker has let the call go (its end
 * closed), so no output of the call lands after the shell has the status.  A second
 * one ends it at once. */
static volatile sig_atomic_t ended_by;
static int call_sock = -1;
static const int LET_GO[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

static void let_go(int sig) {
    if (ended_by) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    ended_by = sig;
    shutdown(call_sock, SHUT_WR);
}

static void end_as_asked(int sock, int pidfd) {
    if (!ended_by) return;
    struct buf rest = {0};
    read_reply(sock, &rest, pidfd); /* (to the worker's end; one silent is killed) */
    signal(ended_by, SIG_DFL);
    raise(ended_by);
    _exit(128 + ended_by);
}

#ifdef OPCACHE_TEST
/* tests/test_client_memo.py's: `xxh64 SEED OFFSET` hashes stdin placed OFFSET bytes
 * into a buffer; `name WORDS...` prints the memo name of that command line here;
 * `socket` the server's socket name for this environment. */
int main(int argc, char **argv) {
    char cwd[PATH_MAX], name[NAME_SIZE > 34 ? NAME_SIZE : 34], *data;
    size_t len;
    if (argc == 4 && strcmp(argv[1], "xxh64") == 0 && read_whole(0, 1u << 30, &data, &len) == 0) {
        size_t offset = (size_t)atoi(argv[3]);
        char *placed = malloc(len + offset + 1);
        memcpy(placed + offset, data, len);
        printf("%016llx\n", (unsigned long long)xxh64(placed + offset, len, strtoull(argv[2], NULL, 10)));
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "socket") == 0 && socket_name(name) == 0) {
        printf("%s\n", name);
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "name") == 0 && getcwd(cwd, sizeof cwd) != NULL &&
        memo_name(argv + 2, cwd, name) == 0) {
        printf("%s\n", name);
        return 0;
    }
    return 1;
}
#else
int main(int argc, char **argv) {
    const char *name = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    int masquerade = strcmp(name, "opcache-client") != 0;
    char **line = command_line(argc, argv, masquerade ? started_as(argv[0]) : NULL);
    if (line == NULL) return 127;
    char cwd[PATH_MAX], folder[PATH_MAX];
    int served = masquerade || (argc > 1 && strcmp(argv[1], "wrap") == 0);
    for (int fd = 0; fd < 3; fd++) served = served && fcntl(fd, F_GETFD) >= 0;
    if (!served || getcwd(cwd, sizeof cwd) == NULL) run_opcache(line);
    char memo[34];
    int wants_memo = memo_name(line, cwd, memo) == 0;
    if (wants_memo) serve_memo(memo); /* (returns: not served) */
    int start;
    pid_t server;
    char sock_name[NAME_SIZE];
    if (socket_name(sock_name) != 0) run_opcache(line);
    int sock = connect_server(&start, folder, sizeof folder, sock_name, &server);
    if (sock < 0) {
        if (start) start_server(folder, sock_name);
        run_opcache(line);
    }
    struct buf reply = {0};
    pid_t worker = taken(sock);
    int pidfd = hold_worker(worker, server);
    if (worker > 0) {
        call_sock = sock;
        struct sigaction sa = {.sa_handler = let_go}; /* (no SA_RESTART: a wait sees EINTR) */
        sigemptyset(&sa.sa_mask);
        for (size_t i = 0; i < sizeof LET_GO / sizeof *LET_GO; i++) sigaction(LET_GO[i], &sa, NULL);
    }
    if (worker > 0 && send_request(sock, line, cwd, wants_memo) == 0 && read_reply(sock, &reply, pidfd) == 0) {
        end_as_asked(sock, pidfd);
        int status = replay(&reply);
        if (status >= 0) return status;
    }
    end_as_asked(sock, pidfd);
    run_opcache(line);
}
#endif
