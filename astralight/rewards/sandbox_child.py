"""The code that runs inside the sandbox's processes, as Python source strings.

Kept as strings so that the child needs no import of this package (its ``sys.path`` has no
site-packages) and starts from a clean interpreter. :mod:`astralight.rewards.sandbox_process`
starts ``python -I -S -B -c LAUNCHER CONFIG_JSON``; the launcher sets up the namespaces, forks
a child that drops to the sandbox uid, sets the resource limits and execs
``python -I -S -B -c RUNNER``, which installs the audit-hook guard and runs the program (or, for
:func:`~astralight.rewards.sandbox.run_call`, calls its function and writes the result record).

- :data:`LAUNCHER` reads its JSON configuration from ``argv[1]``, waits for the program and
  reports its exit status or signal and its CPU time as one JSON object on ``status_fd`` (or
  ``{"setup_error"}``).
- :data:`RUNNER` reads the program (or the call spec) from an inherited descriptor and exits
  with :data:`MEMORY_EXIT` on an uncaught ``MemoryError``.
"""

__all__ = ["LAUNCHER", "RUNNER", "MEMORY_EXIT"]

MEMORY_EXIT = 117  # the runner's exit code for an uncaught MemoryError (RLIMIT_AS hit)

LAUNCHER = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
status_fd = cfg["status_fd"]

def report(d):
    try:
        os.write(status_fd, json.dumps(d).encode())
    except OSError:
        pass

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
libc = ctypes.CDLL(None, use_errno=True)

def mount(src, tgt, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(tgt), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s on %s: %s" % (src or fstype, tgt, os.strerror(e)))

class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

def mount_setattr(path, recursive, set_=0, clr=0):
    attr = MountAttr(set_, clr, 0, 0)
    nr = {"x86_64": 442, "aarch64": 442}.get(os.uname().machine, 442)
    r = libc.syscall(ctypes.c_long(nr), ctypes.c_int(-100), path.encode(),
                     ctypes.c_uint(0x8000 if recursive else 0), ctypes.byref(attr),
                     ctypes.c_size_t(ctypes.sizeof(attr)))
    if r != 0:
        raise OSError(ctypes.get_errno(), "mount_setattr " + path)

def make_readonly_except_tmp():
    try:
        mount_setattr("/", True, set_=1)
        mount_setattr("/tmp", False, clr=1)
        return
    except OSError:
        pass
    bits = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    failed = []
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    for e in entries:
        point, opts = e[4].encode().decode("unicode_escape"), e[5].split(",")
        if point == "/tmp":
            continue
        extra = sum(bits.get(o, 0) for o in opts)
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
        except OSError:
            failed.append(point)
    if failed:
        raise OSError(0, "could not make read-only: %s" % failed[:5])

def setup_namespace():
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=755" % cfg["disk_mb"])
    hidden, prefix = cfg["hidden_ancestor"], cfg["prefix"]
    if hidden:
        stage = "/tmp/.interpreter"
        os.mkdir(stage)
        mount(prefix, stage, None, MS_BIND | MS_REC)
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        mount(stage, prefix, None, MS_MOVE)
        os.rmdir(stage)
    make_readonly_except_tmp()
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    return work

try:
    code_fd = os.open(cfg["code_path"], os.O_RDONLY)
    work = setup_namespace() if cfg["namespaces"] else cfg["workdir"]
    uid = cfg["uid"]
    if uid is not None:
        os.chown(work, uid, uid)
    os.chdir(work)
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means exec succeeded
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            os.close(err_r)
            os.set_inheritable(code_fd, True)
            if cfg["result_fd"] >= 0:
                os.set_inheritable(cfg["result_fd"], True)
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            mb = 1024 * 1024
            cpu = cfg["cpu_limit"]
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
            resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_mb"] * mb,) * 2)
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
            py = cfg["python"]
            os.execve(py, [py, "-I", "-S", "-B", "-c", cfg["runner"], str(code_fd),
                           "1" if cfg["guard"] else "0", str(cfg["memory_exit"]),
                           str(cfg["result_fd"])], {})
        except BaseException as e:
            try:
                os.write(err_w, ("%s: %s" % (type(e).__name__, e)).encode())
            finally:
                os._exit(127)
    os.close(err_w)
    os.close(code_fd)
    if cfg["result_fd"] >= 0:
        os.close(cfg["result_fd"])  # only the runner may hold the result pipe open
    err = b""
    while True:
        chunk = os.read(err_r, 4096)
        if not chunk:
            break
        err += chunk
    while True:
        wpid, st, ru = os.wait4(-1 if cfg["namespaces"] else pid, 0)
        if wpid == pid:
            break
    if err:
        report({"setup_error": "starting the program: " + err.decode(errors="replace")})
    else:
        out = {"cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_kb": ru.ru_maxrss}
        if os.WIFSIGNALED(st):
            out["signal"] = os.WTERMSIG(st)
        else:
            out["exit"] = os.WEXITSTATUS(st)
        report(out)
except BaseException as e:
    report({"setup_error": "%s: %s" % (type(e).__name__, e)})
'''

RUNNER = r'''
import sys, posix as os_
def _guard(root):
    import posixpath
    O_W = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND
    blocked = frozenset([
        "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
        "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
        "resource.setrlimit", "resource.prlimit", "code.__new__", "os.startfile"])
    blocked_prefixes = ("socket.", "ctypes.", "_winapi.")
    blocked_modules = frozenset(["ctypes", "_ctypes", "_posixsubprocess", "cffi", "_testcapi",
                                 "_testinternalcapi", "_xxsubinterpreters", "_xxinterpchannels"])
    first_path = frozenset(["os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                            "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
                            "os.setxattr", "os.removexattr", "shutil.rmtree", "shutil.chown"])
    both_paths = frozenset(["os.rename", "os.link", "shutil.copyfile", "shutil.copymode",
                            "shutil.copystat", "shutil.copytree", "shutil.move"])
    writable_files = frozenset(["/dev/null"])

    def inside(p):
        if isinstance(p, int):
            return True  # an already-open descriptor
        try:
            p = os_.fsdecode(p) if hasattr(os_, "fsdecode") else (
                p.decode() if isinstance(p, bytes) else str(p))
            full = posixpath.realpath(posixpath.join(os_.getcwd(), p))
        except Exception:
            return False
        return full == root or full.startswith(root + "/") or full in writable_files

    def deny(event, detail=""):
        raise PermissionError("sandbox: %s is not allowed%s" % (event, detail))

    def hook(event, args):
        if event in blocked or event.startswith(blocked_prefixes):
            deny(event)
        if event == "import":
            if str(args[0]).partition(".")[0] in blocked_modules:
                deny("importing " + str(args[0]))
        elif event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & O_W)
            if writing and not inside(path):
                deny("writing " + repr(path), " (outside the working directory)")
        elif event in first_path:
            if not inside(args[0]):
                deny(event + " " + repr(args[0]), " (outside the working directory)")
        elif event in both_paths or event == "os.symlink":
            paths = args[1:2] if event == "os.symlink" else args[0:2]
            for p in paths:
                if not inside(p):
                    deny(event + " " + repr(p), " (outside the working directory)")

    sys.addaudithook(hook)

def _out_of_memory(g, memory_exit):
    g.clear()
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os_.write(2, b"MemoryError: the program exceeded its memory limit\n")
    os_._exit(memory_exit)

def _call(raw, result_fd, guard, memory_exit):
    # Function-call harness (see run_call): everything it needs is read and bound before the
    # candidate's code runs; the expected value is never here, only the arguments.
    import json
    spec = json.loads(raw)
    dumps, write = json.dumps, os_.write
    nonce, fn_name = spec["nonce"], spec["fn_name"]
    args = json.loads(spec["args"])
    prelude = compile(spec["prelude"], "<prelude>", "exec")
    code = compile(spec["code"], "solution.py", "exec")
    del spec, raw
    sys.argv = ["solution.py"]
    if guard:
        import posixpath
        _guard(posixpath.realpath(os_.getcwd()))
    # not "__main__": an `if __name__ == "__main__":` block (a stdin driver) must not run
    g = {"__name__": "solution", "__builtins__": __builtins__, "__file__": "solution.py"}
    try:
        exec(prelude, g)
        exec(code, g)
        cls = g.get("Solution")
        if isinstance(cls, type) and hasattr(cls, fn_name):
            target = getattr(cls(), fn_name)  # LeetCode style
        elif callable(g.get(fn_name)):
            target = g[fn_name]
        else:
            raise NameError("the program defines neither Solution.%s nor a function %s"
                            % (fn_name, fn_name))
        value = target(*args)
        line = dumps({"nonce": nonce, "value": value}) + "\n"
    except MemoryError:
        _out_of_memory(g, memory_exit)
    data = line.encode("ascii")
    while data:
        data = data[write(result_fd, data):]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os_._exit(0)  # no atexit hooks or lingering threads of the program run after the record

def _main():
    code_fd, guard, memory_exit = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    result_fd = int(sys.argv[4])
    chunks = []
    while True:
        b = os_.read(code_fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os_.close(code_fd)
    raw = b"".join(chunks)
    del chunks
    if result_fd >= 0:
        return _call(raw, result_fd, guard, memory_exit)
    code = compile(raw, "solution.py", "exec")
    sys.argv = ["solution.py"]
    if guard:
        import posixpath
        _guard(posixpath.realpath(os_.getcwd()))
    g = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "solution.py"}
    try:
        exec(code, g)
    except MemoryError:
        _out_of_memory(g, memory_exit)

_main()
'''
