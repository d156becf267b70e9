"""Run an untrusted Python program (a model's completion plus its unit tests) and contain it.

:func:`run_program` writes the source to a fresh temporary directory, runs it in a child
``python -I -S -B`` with the limits of a :class:`SandboxLimits`, feeds it ``stdin``, reads at most
``max_output_bytes`` of its output, and returns a :class:`SandboxResult` (passed or not, and a
one-line reason). Whatever the program does, the call returns within ``wall_s`` plus a fraction of
a second, every process it started is gone, and the temporary directory is removed. If the
caller itself dies mid-run (a reward worker killed on its timeout), the program dies with it
(parent-death signals; PID 1, which may have armed its own too late, also exits when the status
pipe has lost its reader) and the next run removes the directory left behind, killing anything
of that run still alive.

Layers of containment, from the strongest. The first three are enforced by the kernel and hold
against any program, including native code; the fourth is a convenience that gives clear reasons.

1. **Resource limits** (``setrlimit``, inherited by every process the program starts): CPU
   seconds (``RLIMIT_CPU``; SIGXCPU, then SIGKILL one second later), address space
   (``RLIMIT_AS``: allocations fail, Python raises MemoryError), file size (``RLIMIT_FSIZE``),
   open files (``RLIMIT_NOFILE``), no core files, and processes (``RLIMIT_NPROC``, which counts
   the threads of every process of the *real uid*; root ignores it, hence the uid below).
2. **The parent's supervision**: the child leads a new session; at ``wall_s``, at
   ``max_output_bytes`` (stdout + stderr), or when it exits, PID 1 of its namespace (through a
   pidfd) and the whole process group are killed with SIGKILL (before the leader is reaped, so
   the group id cannot have been reused). Output is read without blocking into a bounded
   buffer, and stdin is written without blocking, so a program that floods its output or never
   reads its input cannot stall the trainer or fill its memory.
3. **Namespaces**, from one of two builders; ``"auto"`` takes the first whose probe run works.

   - ``isolation="bubblewrap"``, the one used wherever ``bwrap`` (Debian's ``bubblewrap``;
     ``launch/setup_env.sh`` installs it) is installed: the launcher runs under ``bwrap``, which
     builds the sandbox below (its command line: :mod:`logra_megatron.rl.sandbox_bwrap`). The
     launcher is PID 1 of the new PID namespace and forks the program; as root it switches the
     program to the sandbox uid itself; everything else here (limits, supervision, status pipe,
     reasons, cleanup) is shared by both builders.
   - ``isolation="namespaces"``, the **fallback** where bubblewrap is not installed: this
     module's own code (``unshare`` and ``pivot_root`` through ctypes, from ``_enter_namespaces``
     on). The launcher unshares mount, network, PID, IPC and UTS namespaces (plus a user
     namespace when the trainer is not root) and forks the program as PID 1 of the new PID
     namespace.

   Either way the program gets:

   - *no network*: a new network namespace has only a loopback interface (down on the fallback;
     bubblewrap brings it up, and nothing but the program can listen on it);
   - *no view of the trainer's processes*: they are not in the PID namespace, so ``os.kill`` of
     the trainer's pid cannot name it; when PID 1 ends (or its launcher dies: parent-death
     signal) the kernel kills every process in the namespace, so nothing outlives a run, not
     even a process that left the session with ``setsid``;
   - *no view of the trainer's files*: the program runs under ``pivot_root`` in a new root
     (tmpfs) that holds only read-only bind mounts of ``/usr``, ``/lib*``, ``/bin``, ``/sbin``,
     the interpreter's prefix and ``/dev/{null,zero,full,random,urandom}``, a ``/proc`` of its
     own PID namespace (read-only on the fallback; bubblewrap makes its ``sys`` and the like
     read-only), under bubblewrap ``/launcher`` (the launcher's four source files and the
     program, read-only), and ``/sandbox`` (its working directory, ``HOME`` and
     ``TMPDIR``; ``/tmp`` links there), a tmpfs of at most ``disk_bytes`` (and, on the fallback,
     4096 inodes; bubblewrap's ``--tmpfs`` takes only a size). Nothing else of the
     host (``/etc``, ``/home``, ``/root``, ``/work``, ``/tmp``...) exists for it, and the old
     root is detached. Writing, deleting or reading outside ``/sandbox`` therefore fails with
     ENOENT or EROFS;
   - *no privileges*: as root, the program drops to an otherwise unused uid (``60000 + pid %
     5000``, under bubblewrap a random one of those, so ``RLIMIT_NPROC`` binds and counts only
     the sandbox: bwrap's own ``--uid`` would map it to host root, which that limit ignores,
     so bwrap runs without a user namespace there); otherwise the user
     namespace maps the trainer's uid to itself and the program drops every capability. Then
     ``PR_SET_NO_NEW_PRIVS``. Mounts copied into any namespace it creates later are locked by
     the kernel, so it cannot make the read-only binds writable.

4. **An audit hook** (``audit_guard=True``, :func:`sys.addaudithook`, installed by the launcher
   in the program's own interpreter before its first line runs). It ends the program at once
   (exit status 118) on: opening for write, creating, renaming or deleting a path outside the
   sandbox directory; reading or listing a path outside the sandbox directory and the Python
   standard library; creating a non-Unix socket, connecting, binding, or resolving names
   ("network blocked"); ``os.kill``/``os.killpg`` of another process; creating a process
   (fork, exec, spawn, ``os.system``, ``subprocess`` -- importing it counts, since its
   ``_posixsubprocess`` forks without an audit event); ctypes; changing rlimits. The reason
   goes to the parent through a pipe. *An audit hook is not a security boundary*: native code,
   races between the check and the use of a path, or tampering through ``gc`` can get around
   it. It is what makes a hostile program fail with a precise reason, and it is the only guard
   of the file system and of process creation by root when namespaces are unavailable.

Where neither builder works (``isolation="none"``: e.g. a container whose seccomp profile forbids
``unshare``) layers 1, 2 and 4 remain; the program then runs in ``<tmpdir>/work`` as the trainer's
user, can see the host's files (the hook refuses them) and, as root, ``RLIMIT_NPROC`` does not
bind (the hook refuses process creation); running without both namespaces and the hook is
refused. :func:`isolation_report` says which layers a run gets on this machine.

A program *passes* when it runs to the end of its source and exits with status 0. Ending early
with status 0 (``sys.exit(0)``, ``os._exit(0)`` before the tests that follow a completion: the
usual way to game a code reward) does not pass: after the source has run, the launcher sends a
nonce it announced before the program started, and only the kernel's exit status and that
line count. Status lines can be written by the program too, so they can only make it fail; a
program that walked the interpreter's frames up to the launcher could find the nonce (the hook
does not forbid introspection, which logging and tracebacks use).

Reasons (:attr:`SandboxResult.reason`): ``"passed"``; the parent's ``"timeout"`` and ``"output
limit"``; the kernel limits' ``"cpu time limit"``, ``"memory limit"``, ``"file size limit"``;
``"killed by signal N"``; ``"exit status N: <last line of stderr>"``; ``"exited before the end of
the program (status 0)"``; the audit hook's ``"network blocked"``, ``"process creation
blocked"``, ``"signal to another process blocked"``, ``"write outside sandbox: PATH"``, ``"read
outside sandbox: PATH"``, ``"ctypes blocked"``, ``"rlimit change blocked"``; or ``"sandbox setup
failed: ..."``.

The program gets the standard library only (``-S``: no site-packages) and a minimal
environment; its text arrives as a file of the temporary directory, its stdin through a pipe.
"""

import functools
import json
import os
import platform
import select
import selectors
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from logra_megatron.errors import UserError

MiB = 1 << 20
VIOLATION_EXIT = 118
"""Exit status of a program ended by the audit hook (the reason comes through the status pipe)."""
SETUP_EXIT = 117
"""Exit status of a launcher that could not build the sandbox."""
DRAIN_GRACE_S = 0.2
"""After the launcher exits, how long to keep reading output that is still in the pipes."""
EXIT_POLL_S = 0.02
"""Without pidfds, how often to check whether the launcher exited."""
INIT_EXIT_WAIT_S = 5.0
"""Bound on waiting for the namespace's PID 1 to end after SIGKILL (the kernel empties the
namespace first; this takes milliseconds)."""
SANDBOX_UID_BASE, SANDBOX_UID_SPAN = 60000, 5000
"""As root, the program runs as ``SANDBOX_UID_BASE + launcher pid % SANDBOX_UID_SPAN``: a uid no
account uses (Debian's UID_MAX is 60000) and that a rootless container still maps (< 65536)."""
WORKDIR_PREFIX = "logra-sandbox-"
"""Temporary directories are ``<tmp>/logra-sandbox-<pid of the caller>-<random>``."""
SANDBOX_DIR = "/sandbox"
"""The program's working directory inside the namespace sandbox."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. Validated on construction (a :class:`UserError` names the field)."""

    wall_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    cpu_s: float = 5.0
    """CPU seconds per process (``RLIMIT_CPU``, rounded up to whole seconds)."""
    memory_bytes: int = 512 * MiB
    """Address space per process (``RLIMIT_AS``); the interpreter itself needs ~30 MiB."""
    max_processes: int = 8
    """Processes and threads the program may have, itself included (``RLIMIT_NPROC``)."""
    max_output_bytes: int = 1 * MiB
    """stdout + stderr kept; more kills the program ("output limit")."""
    max_file_bytes: int = 16 * MiB
    """Largest file it may write (``RLIMIT_FSIZE``)."""
    disk_bytes: int = 64 * MiB
    """Size of its working directory (a tmpfs; namespace isolation only)."""
    open_files: int = 64
    """File descriptors (``RLIMIT_NOFILE``)."""

    def __post_init__(self):
        for name in ("wall_s", "cpu_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise UserError(f"SandboxLimits.{name} must be a positive number of seconds, got {value!r}")
        for name in ("memory_bytes", "max_processes", "max_output_bytes", "max_file_bytes", "disk_bytes",
                     "open_files"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"SandboxLimits.{name} must be a positive integer, got {value!r}")
        if self.open_files < 8:
            raise UserError(f"SandboxLimits.open_files must be at least 8 (the interpreter needs a few), "
                            f"got {self.open_files}")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of :func:`run_program`."""

    passed: bool
    """Ran to the end of its source and exited with status 0, within every limit, and the audit
    hook saw no violation."""
    reason: str
    """``"passed"`` or why not (module docstring)."""
    returncode: Optional[int]
    """The program's exit status; ``-N`` when signal N ended it."""
    stdout: str
    stderr: str
    """Output, decoded as UTF-8 (bad bytes replaced), together at most ``max_output_bytes``."""
    elapsed_s: float
    cpu_s: float
    """CPU seconds used by the program and every process it waited for."""
    isolation: str
    """``"bubblewrap"``, ``"namespaces"`` or ``"none"``."""
    workdir: str
    """The temporary directory it ran in; removed before the call returned (see ``cleaned``)."""
    cleaned: bool
    """Whether that directory is gone."""

    @property
    def ok(self) -> bool:
        return self.passed


ISOLATIONS = ("auto", "bubblewrap", "namespaces", "none")


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *,
                isolation: str = "auto", audit_guard: bool = True) -> SandboxResult:
    """Run ``source`` as ``__main__`` in a sandbox (module docstring) and report how it ended.

    ``isolation``: ``"auto"`` (bubblewrap when it is installed and works here, else namespaces
    when they work, else ``"none"``), ``"bubblewrap"`` or ``"namespaces"`` (required: a machine
    where they do not work gives a failed run with the reason), or ``"none"``.
    ``audit_guard=False`` leaves out the audit hook (tests use it to check the kernel layers
    alone); it is refused with ``isolation="none"``, where nothing else would guard the files.
    """
    if not isinstance(source, str):
        raise UserError(f"run_program: source must be a str, got {type(source).__name__}")
    if not isinstance(stdin, str):
        raise UserError(f"run_program: stdin must be a str, got {type(stdin).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise UserError(f"run_program: limits must be a SandboxLimits, got {type(limits).__name__}")
    if isolation not in ISOLATIONS:
        raise UserError(f"run_program: isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isolation == "auto":
        isolation = selected_isolation()
    if isolation == "bubblewrap":
        from logra_megatron.rl.sandbox_bwrap import find_bwrap

        if find_bwrap() is None:
            raise UserError("run_program: isolation='bubblewrap' needs bwrap (Debian/Ubuntu: apt-get install "
                            "bubblewrap); isolation='auto' falls back to namespaces")
    if isolation == "none" and not audit_guard:
        raise UserError("run_program: audit_guard=False needs isolation='bubblewrap' or 'namespaces'; without "
                        "both nothing keeps the program off the trainer's files")
    return _run(source, stdin, limits, isolation, audit_guard)


def _probe(isolation: str) -> str:
    """``""`` when a trivial program runs under ``isolation`` here, else why not."""
    result = _run('print("sandbox ok")', "", SandboxLimits(wall_s=30.0), isolation, True)
    if result.passed and result.stdout.strip() == "sandbox ok":
        return ""
    return result.reason


@functools.lru_cache(maxsize=None)
def bubblewrap_probe() -> str:
    """``""`` when ``bwrap`` is installed and a run under it works here, else why not (cached)."""
    from logra_megatron.rl.sandbox_bwrap import find_bwrap

    if find_bwrap() is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    return _probe("bubblewrap")


@functools.lru_cache(maxsize=None)
def namespace_probe() -> str:
    """``""`` when the fallback's namespace isolation works on this machine, else why not (cached)."""
    return _probe("namespaces")


def bubblewrap_works() -> bool:
    return bubblewrap_probe() == ""


def namespaces_work() -> bool:
    return namespace_probe() == ""


def selected_isolation() -> str:
    """What ``isolation="auto"`` uses here: bubblewrap, else the namespaces fallback, else none."""
    if bubblewrap_works():
        return "bubblewrap"
    return "namespaces" if namespaces_work() else "none"


def isolation_report() -> str:
    """One line for the run log: which containment path and layers a sandboxed program gets here."""
    isolation = selected_isolation()
    if isolation == "none":
        return (f"sandbox: rlimits and audit hook only (bubblewrap: {bubblewrap_probe()}; "
                f"namespaces: {namespace_probe()})")
    who = (f"uid {SANDBOX_UID_BASE}+ (dropped from root)" if os.geteuid() == 0
           else "user namespace, no capabilities")
    path = ("bubblewrap" if isolation == "bubblewrap"
            else f"namespaces fallback (bubblewrap: {bubblewrap_probe()})")
    return (f"sandbox: {path}: pid, net, ipc, uts, mount namespaces, private read-only root, {who}, "
            f"rlimits, audit hook")


# --- the parent side ---------------------------------------------------------------------------

def _run(source: str, stdin: str, limits: SandboxLimits, isolation: str, audit_guard: bool) -> SandboxResult:
    start = time.monotonic()
    _sweep_abandoned_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    status_read = process = init_fd = None
    try:
        program_path = os.path.join(workdir, "program.py")
        with open(program_path, "w", encoding="utf-8") as program_file:
            program_file.write(source)
        os.mkdir(os.path.join(workdir, "root"))  # the namespace sandbox's new root is mounted here
        os.mkdir(os.path.join(workdir, "work"), 0o700)  # the working directory without namespaces
        status_read, status_write = os.pipe()
        config = {"workdir": workdir, "isolation": isolation, "audit_guard": audit_guard,
                  "status_fd": status_write, "parent_pid": os.getpid(), "limits": limits.__dict__}
        pass_fds = (status_write,)
        if isolation == "bubblewrap":
            # bwrap writes PID 1's pid to its info fd: a second descriptor of the status pipe
            # (bwrap closes the info fd, and the launcher needs the status one).
            pass_fds += (os.dup(status_write),)
            command = _bubblewrap_command(config, program_path, limits, pass_fds[1])
        else:
            command = [sys.executable, "-I", "-S", "-B", "-c", _LAUNCH.format(root=_PROJECT_ROOT),
                       json.dumps(config)]
        environment = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
        try:
            process = _start(command, environment, workdir, pass_fds, bool(stdin), isolation == "bubblewrap")
        finally:
            for fd in pass_fds:
                os.close(fd)
        outputs, status, stopped_by, init_fd = _supervise(process, stdin.encode(), status_read, limits, start)
    finally:
        init_known = init_fd is not None
        returncode, cpu = _end(process, init_fd)
        if isolation != "none" and process is not None and not init_known:
            # Stopped before bwrap or the launcher said which pid is PID 1 (mid-setup, e.g. at the
            # wall limit on a loaded machine): PID 1 may not have armed its parent-death signal yet.
            _kill_processes_of(workdir)
        if status_read is not None:
            os.close(status_read)
        cleaned = _remove_tree(workdir)
    stdout = outputs["stdout"].decode("utf-8", "replace")
    stderr = outputs["stderr"].decode("utf-8", "replace")
    returncode = _program_returncode(returncode, status)
    reason = _reason(stopped_by, status, returncode, cpu, stderr, limits)
    return SandboxResult(passed=reason == "passed", reason=reason, returncode=returncode, stdout=stdout,
                         stderr=stderr, elapsed_s=time.monotonic() - start, cpu_s=cpu, isolation=isolation,
                         workdir=workdir, cleaned=cleaned)


_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAUNCH = ("import sys; sys.path.insert(0, {root!r}); "
           "from logra_megatron.rl.sandbox import launch; launch(sys.argv[1])")


def _bubblewrap_command(config: dict, program_path: str, limits: SandboxLimits, info_fd: int) -> list:
    """``bwrap ... -- python -c <launcher> <config>`` (sandbox_bwrap.py). As root, the program's
    uid is chosen here, where the host's processes are visible, and so is ``RLIMIT_NPROC``'s base:
    the processes that uid has already (none, unless another run drew the same uid)."""
    from logra_megatron.rl import sandbox_bwrap

    bwrap = sandbox_bwrap.find_bwrap()  # run_program checked that there is one
    as_root = os.geteuid() == 0
    if as_root:
        # From the OS, not ``random``: reward workers forked from one trainer share its state.
        config["sandbox_uid"] = SANDBOX_UID_BASE + int.from_bytes(os.urandom(4), "little") % SANDBOX_UID_SPAN
        config["process_base"] = _processes_of_uid(config["sandbox_uid"])
    launch_code = _LAUNCH.format(root=sandbox_bwrap.LAUNCHER_DIR)
    return (sandbox_bwrap.bwrap_command(bwrap, _PROJECT_ROOT, program_path, limits.disk_bytes, info_fd, as_root)
            + ["--", sandbox_bwrap.interpreter(), "-I", "-S", "-B", "-c", launch_code, json.dumps(config)])


def _start(command, environment, workdir, pass_fds, feed_stdin, arm_death_signal):
    """Start the launcher (or bwrap). bwrap arms its parent-death signal only after some of its
    setup, so a caller killed before that left it running: with ``arm_death_signal`` the child
    arms it before exec (it survives exec) and exits at once if the caller died already."""
    import subprocess

    preexec = None
    if arm_death_signal:
        prctl, caller = _libc().prctl, os.getpid()  # resolved before the fork: no imports in the child

        def preexec():
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != caller:
                os._exit(SETUP_EXIT)
    return subprocess.Popen(command, stdin=subprocess.PIPE if feed_stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
                            start_new_session=True, cwd=workdir, env=environment, close_fds=True,
                            preexec_fn=preexec)


def _supervise(process, stdin_bytes: bytes, status_read: int, limits: SandboxLimits, start: float):
    """Feed stdin, collect output and status lines until the launcher exits (plus a short drain),
    the wall limit, or the output limit. Returns ``(outputs, status lines, why we stopped it, a
    pidfd of the namespace's PID 1 or None)``."""
    outputs = {"stdout": bytearray(), "stderr": bytearray()}
    status = bytearray()
    init_fd = None
    selector = selectors.DefaultSelector()
    for name, stream in (("stdout", process.stdout), ("stderr", process.stderr)):
        os.set_blocking(stream.fileno(), False)
        selector.register(stream.fileno(), selectors.EVENT_READ, name)
    selector.register(status_read, selectors.EVENT_READ, "status")
    if process.stdin is not None:
        os.set_blocking(process.stdin.fileno(), False)
        selector.register(process.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
    exit_fd = _pidfd(process.pid)  # readable when the launcher exits; does not reap it
    if exit_fd is not None:
        selector.register(exit_fd, selectors.EVENT_READ, "exit")
    deadline, exited_at, stopped_by, written = start + limits.wall_s, None, None, 0
    try:
        while stopped_by is None:
            now = time.monotonic()
            if now >= deadline:
                stopped_by = "timeout"
                break
            pipes_open = any(key.data in ("stdout", "stderr", "status") for key in selector.get_map().values())
            if exited_at is not None and (not pipes_open or now >= exited_at + DRAIN_GRACE_S):
                break
            wait = deadline - now if exited_at is None else min(deadline, exited_at + DRAIN_GRACE_S) - now
            if exit_fd is None and exited_at is None:  # no pidfd (Linux < 5.3): poll for the exit
                if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    exited_at = now
                wait = min(wait, EXIT_POLL_S)
            for key, _ in selector.select(max(wait, 0.0)):
                if key.data == "exit":
                    exited_at = time.monotonic()
                    selector.unregister(exit_fd)
                elif key.data == "stdin":
                    written = _feed(process, selector, stdin_bytes, written)
                else:
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                    elif key.data == "status":
                        status += chunk[:4096 - len(status)]
                        if init_fd is None:
                            init_fd = _open_init(process.pid, status)
                    else:
                        outputs[key.data] += chunk
                        if len(outputs["stdout"]) + len(outputs["stderr"]) > limits.max_output_bytes:
                            stopped_by = "output limit"
                            break
    finally:
        selector.close()
        if exit_fd is not None:
            os.close(exit_fd)
    _trim(outputs, limits.max_output_bytes)
    return outputs, status.decode("utf-8", "replace").splitlines(), stopped_by, init_fd


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3, or the process is gone
        return None


def _open_init(launcher_pid: int, status: bytes) -> Optional[int]:
    """A pidfd of PID 1 of the sandbox's PID namespace, from the status pipe's first line: the
    namespaces launcher's ``init N``, or bwrap's ``{"child-pid": N, ...}`` (its info fd is this pipe).

    The pid is checked to be a child of the launcher (or of bwrap; neither has another), so a
    line forged by the program cannot point us at another process; the pidfd then keeps naming
    that process even after it exits.
    """
    lines = bytes(status).split(b"\n")
    if len(lines) < 2:
        return None
    if lines[0].startswith(b"init "):
        number = lines[0].split()[1:2]
    elif len(lines) > 2 and lines[0] == b"{" and lines[1].strip().startswith(b'"child-pid":'):
        number = lines[1].split(b":")[1].strip(b" ,").split()
    else:
        return None
    try:
        pid = int(number[0])
    except (ValueError, IndexError):
        return None
    init_fd = _pidfd(pid)
    if init_fd is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status_file:
            parent = next(int(line.split()[1]) for line in status_file if line.startswith("PPid:"))
    except (OSError, StopIteration, ValueError):
        parent = None
    if parent != launcher_pid:
        os.close(init_fd)
        return None
    return init_fd


def _feed(process, selector, stdin_bytes: bytes, written: int) -> int:
    """Write the next chunk of stdin; close it when done or when the program closed its end."""
    try:
        written += os.write(process.stdin.fileno(), stdin_bytes[written:written + (1 << 16)])
    except BlockingIOError:
        return written
    except OSError:  # BrokenPipe: the program exited or closed stdin; what it did not read is dropped
        written = len(stdin_bytes)
    if written >= len(stdin_bytes):
        selector.unregister(process.stdin.fileno())
        process.stdin.close()
    return written


def _trim(outputs: dict, budget: int) -> None:
    """Keep at most ``budget`` bytes of stdout and stderr together, stdout first."""
    outputs["stdout"] = bytes(outputs["stdout"][:budget])
    outputs["stderr"] = bytes(outputs["stderr"][:max(0, budget - len(outputs["stdout"]))])


def _end(process, init_fd: Optional[int]):
    """Kill whatever is left (PID 1 of the namespace, then the process group), reap the launcher,
    and wait for the namespace to be empty: ``(returncode, cpu seconds)``."""
    if init_fd is not None:
        try:
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)  # the kernel then kills the namespace
        except OSError:
            pass  # already gone
    if process is None:
        return None, 0.0
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the leader is not reaped yet, so its group id is ours
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
    _, wait_status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(wait_status)  # so Popen does not wait again
    if init_fd is not None:
        # PID 1 ends only once every process of its namespace has: wait for that, then it is clean.
        # poll, not select: select() fails on descriptors above 1024, which a long-lived trainer
        # (or a test process) reaches.
        waiter = select.poll()
        waiter.register(init_fd, select.POLLIN)
        waiter.poll(INIT_EXIT_WAIT_S * 1000)
        os.close(init_fd)
    return process.returncode, usage.ru_utime + usage.ru_stime


def _program_returncode(returncode: Optional[int], status_lines: list) -> Optional[int]:
    """``-N`` when the namespace launcher relays that signal N killed PID 1 (it exits 128 + N)."""
    relayed = next((line.split() for line in status_lines if line.startswith("exit ")), [])
    if len(relayed) == 3 and relayed[1] == "signal" and relayed[2].isdigit() and returncode == 128 + int(relayed[2]):
        return -int(relayed[2])  # a forged line can only rename an exit status that is not 0
    return returncode


def _reason(stopped_by, status_lines, returncode, cpu, stderr, limits) -> str:
    """The one-line reason for the result (module docstring), most specific first.

    The status lines come from a pipe the program can also write to, so they may only make a
    run fail or name why; success needs the launcher's real exit status 0 *and* the completion
    line carrying the nonce the launcher announced before the program's first line ran.
    """
    if stopped_by:
        return stopped_by
    reported, completions = {}, set()
    for line in status_lines:
        kind, _, text = line.partition(" ")
        if kind == "completed":
            completions.add(text)
        else:
            reported.setdefault(kind, text)
    for kind in ("violation", "setup", "limit"):
        if kind in reported:
            return "sandbox setup failed: " + reported[kind] if kind == "setup" else reported[kind]
    signal_number = -returncode if returncode is not None and returncode < 0 else None
    if signal_number is not None:
        if signal_number == signal.SIGXCPU or (signal_number == signal.SIGKILL and cpu >= int(limits.cpu_s + 0.999)):
            return "cpu time limit"
        if signal_number == signal.SIGXFSZ:
            return "file size limit"
        return f"killed by signal {signal_number}"
    if returncode:
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        return f"exit status {returncode}" + (f": {lines[-1][:200]}" if lines else "")
    if "start" not in reported or reported["start"] not in completions:
        return "exited before the end of the program (status 0)"
    return "passed"


def _sweep_abandoned_workdirs() -> None:
    """Remove the directories of runs whose process died before it could (a reward worker killed
    on its timeout: its sandbox died with it, by the parent-death signal, but left its directory).
    The creating process's pid is in the name; a directory whose process lives is left alone."""
    directory = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(directory) if name.startswith(WORKDIR_PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            owner = int(name[len(WORKDIR_PREFIX):].split("-", 1)[0])
            os.kill(owner, 0)
        except ValueError:
            continue  # not one of ours
        except ProcessLookupError:
            _kill_processes_of(os.path.join(directory, name))  # e.g. a bwrap child orphaned mid-setup
            _remove_tree(os.path.join(directory, name))
        except PermissionError:
            continue  # another user's live process


def _kill_processes_of(workdir: str) -> None:
    """SIGKILL every process whose command line names ``workdir`` (the launcher's configuration
    and bwrap's binds do; the program's forks share the launcher's): what a run left behind."""
    marker = workdir.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if marker in cmdline.read():
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone meanwhile, or another user's


def _remove_tree(path: str) -> bool:
    """Remove ``path`` whatever the program did to it (read-only or unsearchable directories)."""
    def make_writable_and_retry(function, failed_path, _):
        for directory in {os.path.dirname(failed_path), failed_path}:
            try:
                os.chmod(directory, stat.S_IRWXU)
            except OSError:
                pass
        try:
            function(failed_path)
        except (OSError, TypeError):  # TypeError: rmtree also reports os.open, which needs flags
            pass  # the next pass of rmtree tries again; another user's directory just stays

    for _ in range(3):
        shutil.rmtree(path, onerror=make_writable_and_retry)
        if not os.path.lexists(path):
            return True
    return False


# --- the launcher: runs in the child, before the program ---------------------------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41}
_LOCKED_MOUNT_FLAGS = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                       "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
"""Per-mount flags a read-only remount must repeat (a user namespace may not clear them)."""
SYSTEM_DIRECTORIES = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def launch(config_json: str) -> None:
    """Entry point of the child process (see ``_LAUNCH``): build the sandbox, then run the program."""
    config = json.loads(config_json)
    sys.path.remove(_PROJECT_ROOT)
    status_fd = config["status_fd"]
    bubblewrap = config["isolation"] == "bubblewrap"
    if not bubblewrap:  # under bwrap: armed before bwrap's exec, and the launcher watches the status pipe
        _die_with_parent(config["parent_pid"])

    def report(kind: str, text: str) -> None:
        try:
            os.write(status_fd, f"{kind} {' '.join(str(text).split())}\n".encode())
        except OSError:
            pass  # the program closed the status pipe; the exit status still tells

    limits = SandboxLimits(**config["limits"])
    workdir = config["workdir"]
    with open(os.path.join(_PROJECT_ROOT if bubblewrap else workdir, "program.py"), encoding="utf-8") as program_file:
        source = program_file.read()
    try:
        if bubblewrap:
            sandbox_dir, process_base = _enter_bubblewrap(config, report)  # returns in the program only
        elif config["isolation"] == "namespaces":
            sandbox_dir, process_base = _enter_namespaces(workdir, limits, report, status_fd)  # in PID 1 only
        else:
            sandbox_dir, process_base = os.path.join(workdir, "work"), _processes_of_uid(os.getuid()) - 1
            os.chdir(sandbox_dir)
        os.environ.update(HOME=sandbox_dir, TMPDIR=sandbox_dir)
        _set_limits(limits, process_base)
    except Exception as error:  # noqa: BLE001 -- any failure here must stop the run, with its reason
        report("setup", f"{type(error).__name__}: {error}")
        os._exit(SETUP_EXIT)
    _run_program(source, sandbox_dir, config["audit_guard"], report)


def _die_with_parent(parent_pid: int) -> None:
    """If the process that runs the sandbox dies (a reward worker killed on its timeout, a crashed
    trainer), nobody would enforce the wall limit any more: die with it (parent-death signal)."""
    libc = _libc()
    _checked(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(SETUP_EXIT)


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _checked(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _enter_namespaces(workdir: str, limits: SandboxLimits, report, status_fd: int):
    """Unshare, fork PID 1 of the new PID namespace and, in it, build and enter the private root.

    The launcher (the parent of PID 1) waits for it and relays how it ended, then exits; it never
    returns from here. Returns ``(sandbox dir, processes already counted against RLIMIT_NPROC)``
    in PID 1, running as the sandbox's unprivileged user.
    """
    libc = _libc()
    as_root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if as_root:
        sandbox_uid = SANDBOX_UID_BASE + os.getpid() % SANDBOX_UID_SPAN
        process_base = _processes_of_uid(sandbox_uid)  # counted on the host's /proc, before unsharing
    else:
        flags |= CLONE_NEWUSER
        sandbox_uid, process_base = uid, 1  # the user namespace counts only the launcher and PID 1
    _checked(libc.unshare(flags), "unshare")
    if not as_root:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as map_file:
                map_file.write(text)
    child = os.fork()
    if child:
        report("init", child)  # first status line: the parent kills the namespace through it
        _relay(child, report)
    new_root = os.path.join(workdir, "root")
    _build_root(libc, new_root, limits, sandbox_uid if as_root else None)
    _enter_root(libc, new_root)
    if as_root:
        os.setgroups([])
        os.setresgid(sandbox_uid, sandbox_uid, sandbox_uid)
        os.setresuid(sandbox_uid, sandbox_uid, sandbox_uid)  # all uids non-zero: capabilities cleared
    else:
        _drop_capabilities()
    _checked(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # Set after the uid change, which clears it: if the launcher dies (the trainer's kill), PID 1
    # dies and with it the whole PID namespace.
    _checked(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    _exit_if_caller_gone(status_fd)  # ... unless it died before that, with the caller
    os.chdir(SANDBOX_DIR)
    return SANDBOX_DIR, process_base


def _enter_bubblewrap(config: dict, report):
    """Inside bwrap, as PID 1 of its PID namespace: fork the program and relay how it ended (the
    launcher never returns from here). In the program, as root, take ``/sandbox`` and switch to
    the sandbox uid, which clears the capabilities bwrap left (sandbox_bwrap.py); then as on the
    fallback, ``NO_NEW_PRIVS`` and the parent-death signal. Returns ``(sandbox dir, processes
    already counted against RLIMIT_NPROC)`` in the program."""
    child = os.fork()
    if child:
        _relay(child, report, lifeline=config["status_fd"])
    libc = _libc()
    if "sandbox_uid" in config:
        sandbox_uid = config["sandbox_uid"]
        os.chown(SANDBOX_DIR, sandbox_uid, sandbox_uid)
        os.setgroups([])
        os.setresgid(sandbox_uid, sandbox_uid, sandbox_uid)
        os.setresuid(sandbox_uid, sandbox_uid, sandbox_uid)
        process_base = config["process_base"]  # counted by the parent on the host's /proc
    else:
        process_base = 1  # bwrap's user namespace holds only the launcher besides the program
    _checked(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _checked(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    os.chdir(SANDBOX_DIR)
    return SANDBOX_DIR, process_base


def _relay(child: int, report, lifeline: Optional[int] = None) -> None:
    """The launcher: wait for the program, tell the parent how it ended, and exit the same way.

    ``lifeline`` (under bwrap, where the launcher is PID 1): the status pipe's write end. bwrap's
    child can miss its parent-death signal (armed after part of its setup, cleared by its
    credential changes), and inside the PID namespace ``getppid()`` is 0 whether the caller lives
    or not; but once the caller is gone the pipe has no reader, which ``poll`` reports as POLLERR.
    Then the launcher exits, and the kernel ends the namespace with it."""
    for fd in (0, 1):  # keep only the program's copies of stdin/stdout, so EOF means it is done
        os.close(fd)
    if lifeline is not None:
        _wait_unless_orphaned(child, lifeline)
    _, wait_status, _ = os.wait4(child, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    report("exit", f"signal {-code}" if code < 0 else f"code {code}")
    os._exit(128 - code if code < 0 else code)


def _exit_if_caller_gone(status_fd: int) -> None:
    """Exit if the status pipe has no reader: the caller died (a process's files close before its
    children are signalled, so this holds by the time a launcher it took along is gone). Inside
    the PID namespace ``getppid()`` cannot tell: it is 0 either way."""
    waiter = select.poll()
    waiter.register(status_fd, 0)  # POLLERR and POLLHUP are always reported
    if any(events & (select.POLLERR | select.POLLHUP) for _, events in waiter.poll(0)):
        os._exit(SETUP_EXIT)


def _wait_unless_orphaned(child: int, lifeline: int) -> None:
    """Return when ``child`` exits; exit at once if ``lifeline`` (a pipe's write end) loses its reader."""
    try:
        child_fd = os.pidfd_open(child)
    except (AttributeError, OSError):  # Linux < 5.3: poll for the exit instead
        child_fd = None
    waiter = select.poll()
    waiter.register(lifeline, 0)  # POLLERR and POLLHUP are always reported
    if child_fd is not None:
        waiter.register(child_fd, select.POLLIN)
    while True:
        for fd, events in waiter.poll(None if child_fd is not None else EXIT_POLL_S * 1000):
            if fd == lifeline and events & (select.POLLERR | select.POLLHUP):
                os._exit(SETUP_EXIT)  # the caller died: as PID 1, this ends the program too
            if fd == child_fd:
                return
        if child_fd is None and os.waitid(os.P_PID, child, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return


def _build_root(libc, new_root: str, limits: SandboxLimits, owner: Optional[int]) -> None:
    """Mount the private root at ``new_root`` (module docstring, layer 3)."""
    os.umask(0o022)
    _checked(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    _checked(libc.mount(b"tmpfs", new_root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755"),
             "mount the new root")
    sources = [path for path in SYSTEM_DIRECTORIES if os.path.lexists(path)]
    covered = tuple(os.path.realpath(path) + "/" for path in sources)
    interpreter = os.path.realpath(sys.base_prefix)  # the standard library; not a venv's site-packages
    if not (interpreter + "/").startswith(covered):
        sources.append(interpreter)
    for source in sources:
        target = new_root + source
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
            continue
        os.makedirs(target, exist_ok=True)
        _checked(libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None), f"bind {source}")
    os.makedirs(new_root + "/dev")
    for device in DEVICES:
        if os.path.exists(device):
            open(new_root + device, "w").close()
            _checked(libc.mount(device.encode(), (new_root + device).encode(), None, MS_BIND, None),
                     f"bind {device}")
    for directory in (SANDBOX_DIR, "/proc"):
        os.makedirs(new_root + directory)
    os.symlink(SANDBOX_DIR.lstrip("/"), new_root + "/tmp")
    _remount_read_only(libc, new_root)
    ownership = f",uid={owner},gid={owner}" if owner is not None else ""
    _checked(libc.mount(b"tmpfs", (new_root + SANDBOX_DIR).encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                        f"size={limits.disk_bytes},nr_inodes=4096,mode=0700{ownership}".encode()),
             "mount the sandbox directory")
    proc_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY
    if libc.mount(b"proc", (new_root + "/proc").encode(), b"proc", proc_flags, None) != 0:
        pass  # e.g. a container's masked /proc forbids a new one: the program just has no /proc


def _remount_read_only(libc, new_root: str) -> None:
    """Make every mount under ``new_root`` read-only and nosuid, repeating its locked flags."""
    with open("/proc/self/mountinfo") as mountinfo:
        entries = [line.split() for line in mountinfo]
    for fields in entries:
        mount_point = _unescape(fields[4])
        if mount_point != new_root and not mount_point.startswith(new_root + "/"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for option in fields[5].split(","):
            flags |= _LOCKED_MOUNT_FLAGS.get(option, 0)
        _checked(libc.mount(None, mount_point.encode(), None, flags, None), f"remount {mount_point} read-only")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for escape, character in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escape, character)
    return field


def _enter_root(libc, new_root: str) -> None:
    """``pivot_root`` into ``new_root`` and detach the old root, so no path leads back to it."""
    os.chdir(new_root)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: unknown system call number on {platform.machine()}")
    _checked(libc.syscall(number, b".", b"."), "pivot_root")
    _checked(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def _drop_capabilities() -> None:
    """Clear every capability the user namespace gave (capset with empty sets, version 3)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    libc = ctypes.CDLL(None, use_errno=True)
    _checked(libc.capset(header, data), "capset")


def _processes_of_uid(uid: int) -> int:
    """Tasks (threads count, as for RLIMIT_NPROC) whose real uid is ``uid``, from /proc."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status_file:
                fields = dict(line.split(":", 1) for line in status_file if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue  # the process ended while we looked
    return count


def _set_limits(limits: SandboxLimits, process_base: int) -> None:
    import resource

    cpu = int(limits.cpu_s + 0.999)
    for name, soft, hard in (("RLIMIT_CORE", 0, 0), ("RLIMIT_CPU", cpu, cpu + 1),
                             ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
                             ("RLIMIT_FSIZE", limits.max_file_bytes, limits.max_file_bytes),
                             ("RLIMIT_NOFILE", limits.open_files, limits.open_files),
                             ("RLIMIT_NPROC", process_base + limits.max_processes,
                              process_base + limits.max_processes)):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _run_program(source: str, sandbox_dir: str, audit_guard: bool, report) -> None:
    """Forget the launcher, install the guard, run the program as ``__main__``, and exit."""
    import builtins
    import linecache

    def limit_reached(reason):
        def handler(signum, frame):
            report("limit", reason)
            os._exit(128 + signum)
        return handler

    # Python as PID 1 would ignore these kernel signals; a handler also names the reason.
    signal.signal(signal.SIGXCPU, limit_reached("cpu time limit"))
    signal.signal(signal.SIGXFSZ, limit_reached("file size limit"))
    read_roots = [path for path in sys.path if os.path.exists(path)]
    for name in [name for name in sys.modules if name.startswith(("logra_megatron", "ctypes", "_ctypes"))]:
        del sys.modules[name]
    linecache.cache["program.py"] = (len(source), None, source.splitlines(True), "program.py")
    # Ran to its end, not exited early (sys.exit(0) or os._exit(0) before the tests that follow a
    # completion): the parent needs this line back with this nonce, announced before the
    # program's first line. Only introspection of this frame could find it (module docstring).
    nonce = os.urandom(16).hex()
    report("start", nonce)
    if audit_guard:
        _install_guard(sandbox_dir, read_roots, report)
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__file__": "program.py"}
    try:
        exec(compile(source, "program.py", "exec"), namespace)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        report("completed", nonce)
    except MemoryError:
        report("limit", "memory limit")
        os._exit(1)
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 -- reported like Python does, without our frames
        import traceback

        # From the program's first frame on: showing the launcher's would read its source file,
        # which the guard refuses (and which the namespace root does not contain).
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.exit(1)


def _install_guard(sandbox_dir: str, read_roots: list, report) -> None:
    """The audit hook of layer 4 (module docstring). It ends the process on the first violation."""
    import socket

    realpath, fspath, getpid = os.path.realpath, os.fspath, os.getpid
    sandbox = realpath(sandbox_dir)
    readable = tuple(realpath(path) for path in read_roots) + (sandbox,)
    devices = frozenset(DEVICES)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def deny(reason):
        report("violation", reason)
        os._exit(VIOLATION_EXIT)

    def resolve(path, dir_fd=None):
        """The absolute real path, or None for a file descriptor (already allowed when opened)."""
        if isinstance(path, int) or path is None:
            return None
        path = os.fsdecode(fspath(path))
        if dir_fd not in (None, -1) and not os.path.isabs(path):
            try:
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            except OSError:
                deny(f"write outside sandbox: {path} (relative to an unknown directory)")
        return realpath(path)

    def under(path, roots):
        return path in devices or any(path == root or path.startswith(root + "/") for root in roots)

    def check_write(path, dir_fd=None):
        resolved = resolve(path, dir_fd)
        if resolved is not None and not under(resolved, (sandbox,)):
            deny(f"write outside sandbox: {resolved}")

    def check_read(path, dir_fd=None):
        resolved = resolve("." if path is None else path, dir_fd)
        if resolved is not None and not under(resolved, readable):
            deny(f"read outside sandbox: {resolved}")

    def on_open(path, mode, flags):
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & write_flags
        (check_write if writing else check_read)(path)

    def network(*_):
        deny("network blocked")

    def on_socket(_, family, *__):
        if family != socket.AF_UNIX:
            deny("network blocked")

    def processes(*_):
        deny("process creation blocked")

    def on_kill(pid, *_):
        if pid != getpid():
            deny("signal to another process blocked")

    def on_import(module, *_):
        if module in ("_posixsubprocess", "_ctypes"):
            deny("process creation blocked" if module == "_posixsubprocess" else "ctypes blocked")

    handlers = {
        "open": on_open,
        "os.listdir": lambda path: check_read(path), "os.scandir": lambda path: check_read(path),
        "os.remove": check_write, "os.rmdir": check_write, "shutil.rmtree": check_write,
        "os.mkdir": lambda path, mode, dir_fd=None: check_write(path, dir_fd),
        "os.chmod": lambda path, mode, dir_fd=None: check_write(path, dir_fd),
        "os.chown": lambda path, uid, gid, dir_fd=None: check_write(path, dir_fd),
        "os.truncate": lambda path, length: check_write(path),
        "os.utime": lambda path, *rest: check_write(path),
        "os.symlink": lambda source, destination, dir_fd=None: check_write(destination, dir_fd),
        "os.link": lambda source, destination, *fds: (check_read(source), check_write(destination)),
        "os.rename": lambda source, destination, *fds: (check_write(source), check_write(destination)),
        "os.mkfifo": lambda path, mode, dir_fd=None: check_write(path, dir_fd),
        "os.mknod": lambda path, mode, device, dir_fd=None: check_write(path, dir_fd),
        "socket.__new__": on_socket, "socket.connect": network, "socket.bind": network,
        "socket.sendto": network, "socket.getaddrinfo": network, "socket.gethostbyname": network,
        "socket.gethostbyaddr": network, "socket.getnameinfo": network,
        "os.fork": processes, "os.forkpty": processes, "os.exec": processes, "os.posix_spawn": processes,
        "os.spawn": processes, "os.system": processes, "subprocess.Popen": processes, "pty.spawn": processes,
        "os.kill": on_kill, "os.killpg": lambda *_: deny("signal to another process blocked"),
        "resource.setrlimit": lambda *_: deny("rlimit change blocked"),
        "resource.prlimit": lambda *_: deny("rlimit change blocked"),
        "import": on_import,
    }

    def guard(event, arguments):
        handler = handlers.get(event)
        if handler is not None:
            handler(*arguments)
        elif event.startswith("ctypes."):
            deny("ctypes blocked")

    sys.addaudithook(guard)
