"""Hostile programs in the code-reward sandbox: each is contained, scores 0 with a reason, and
leaves the trainer (this test process), its files and the machine as they were.

Every hostile program runs on each isolation path: bubblewrap (what ``auto`` uses where bwrap is
installed) and the hand-built namespaces fallback, each as the full sandbox (+ audit hook) and as
the kernel layers alone (no hook: shows what holds against native code), and the hook alone (the
last fallback, where no namespaces are available). After each run the test checks that the
call returned within the wall limit plus a margin, that the temporary directory is gone, that no
process of the run is left, that the trainer's files are unchanged, that the trainer received
no signal and that a decoy process standing in for the trainer is alive.
"""

import dataclasses
import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from logra_megatron.errors import UserError
from logra_megatron.rl import sandbox, sandbox_bwrap
from logra_megatron.rl.sandbox import SandboxLimits, namespace_probe, namespaces_work, run_program

LIMITS = SandboxLimits(wall_s=2.5, cpu_s=1.0, memory_bytes=256 << 20, max_processes=4,
                       max_output_bytes=64 << 10, max_file_bytes=1 << 20, disk_bytes=8 << 20)
ROOMY = dataclasses.replace(LIMITS, wall_s=30.0)
"""For runs that must pass: a loaded machine (the CI's, at load 100+) may take seconds to start an
interpreter, which is no escape; the runs that must be stopped keep ``LIMITS``."""
RETURN_MARGIN_S = 2.0
"""A run returns within ``wall_s`` plus this (kill, reap, cleanup; generous for a loaded machine)."""

MODES = {
    "bubblewrap+guard": dict(isolation="bubblewrap", audit_guard=True),
    "bubblewrap-only": dict(isolation="bubblewrap", audit_guard=False),
    "namespaces+guard": dict(isolation="namespaces", audit_guard=True),
    "namespaces-only": dict(isolation="namespaces", audit_guard=False),
    "guard-only": dict(isolation="none", audit_guard=True),
}
SUPERVISORS = {"bubblewrap": 2, "namespaces": 1, "none": 0}
"""Processes of a run that are not the program's and not limited by its RLIMIT_NPROC: bwrap's
monitor outside the PID namespace and the launcher (PID 1 inside it), or the namespaces launcher."""


def skip_unless_available(isolation: str) -> None:
    """Bubblewrap is skipped only where bwrap is not installed (CI installs it): installed but not
    working is a failure of the path ``auto`` prefers. The fallback is skipped where namespaces do
    not work (then the guard-only runs still cover the last fallback)."""
    if isolation == "bubblewrap" and sandbox_bwrap.find_bwrap() is None:
        pytest.skip("bubblewrap path not tested: bwrap is not installed (apt-get install bubblewrap)")
    if isolation == "namespaces" and not namespaces_work():
        pytest.skip(f"namespaces unavailable here: {namespace_probe()}")


@pytest.fixture(params=list(MODES))
def mode(request):
    skip_unless_available(MODES[request.param]["isolation"])
    return MODES[request.param]


def sandbox_processes() -> list:
    """Pids of processes whose command line names a sandbox directory (launcher, program, forks)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if b"logra-sandbox-" in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


class Trainer:
    """What a hostile program might go after: files, this process, and a decoy process."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir()
        self.secret = f"TRAINER-SECRET-{uuid.uuid4().hex}"
        (directory / "secret.txt").write_text(self.secret)
        (directory / "checkpoint.bin").write_bytes(os.urandom(4096))
        self.digests = self.snapshot()
        self.signals = []
        self.previous_handler = signal.signal(signal.SIGUSR1, lambda number, frame: self.signals.append(number))
        self.decoy = subprocess.Popen(["sleep", "120"])
        self.escape = f"logra-escape-{uuid.uuid4().hex}.txt"

    def snapshot(self) -> dict:
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in self.directory.iterdir()}

    def check_unharmed(self):
        assert self.snapshot() == self.digests, "the trainer's files changed"
        assert not self.signals, "the trainer received a signal"
        assert self.decoy.poll() is None, "the decoy process was killed"
        assert not os.path.exists(os.path.join("/tmp", self.escape)), "a file was written to the host's /tmp"

    def close(self):
        signal.signal(signal.SIGUSR1, self.previous_handler)
        self.decoy.kill()
        self.decoy.wait()


@pytest.fixture
def trainer(tmp_path):
    trainer = Trainer(tmp_path / "trainer")
    yield trainer
    trainer.close()


def run_contained(source: str, trainer: Trainer, mode: dict, stdin: str = "", limits: SandboxLimits = LIMITS):
    """Run a hostile program and check every containment promise; returns the result."""
    assert not sandbox_processes(), "a sandbox process was left over by an earlier test"
    started = time.monotonic()
    result = run_program(source, stdin, limits, **mode)
    elapsed = time.monotonic() - started
    print(f"{mode}: {result.reason!r} in {elapsed:.2f}s")  # shown with -s: the measured outcome
    assert not result.passed and result.reason and result.reason != "passed", result
    assert elapsed < limits.wall_s + RETURN_MARGIN_S, f"returned after {elapsed:.1f}s: {result.reason}"
    assert result.cleaned and not os.path.exists(result.workdir), "the sandbox directory is left"
    assert not sandbox_processes(), "processes of the run are still alive"
    trainer.check_unharmed()
    return result


# --- the hostile programs ------------------------------------------------------------------------

def test_infinite_loop(trainer, mode):
    result = run_contained("while True:\n    pass\n", trainer, mode)
    assert result.reason in ("cpu time limit", "timeout"), result.reason


def test_fork_bomb(trainer, mode):
    # Bounded at 2**6 = 64 processes even if nothing stopped it, so a failure cannot hurt the machine.
    bomb = ("import os, time\n"
            "for generation in range(6):\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        pass\n"
            "print('alive', flush=True)\n"
            "time.sleep(60)\n")
    most, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            most[0] = max(most[0], len(sandbox_processes()))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_contained(bomb, trainer, mode)
    finally:
        stop.set()
        watcher.join()
    if mode["audit_guard"]:
        assert result.reason == "process creation blocked"
    else:
        assert result.reason == "timeout"
    assert result.stdout.count("alive") <= LIMITS.max_processes
    assert most[0] <= LIMITS.max_processes + SUPERVISORS[mode["isolation"]], f"{most[0]} sandbox processes at once"


def test_memory_blow_up(trainer, mode):
    hog = "hog = []\nwhile True:\n    hog.append(bytearray(16 << 20))\n"
    assert run_contained(hog, trainer, mode).reason == "memory limit"


def test_writing_outside_its_directory(trainer, mode):
    targets = [trainer.directory / "pwned.txt", trainer.directory / "secret.txt", f"/tmp/{trainer.escape}",
               f"../../{trainer.escape}"]
    program = ("failures = []\n"
               f"for target in {[str(t) for t in targets]!r}:\n"
               "    try:\n"
               "        with open(target, 'a') as f:\n"
               "            f.write('pwned')\n"
               "    except OSError as error:\n"
               "        failures.append(repr(error))\n"
               "print(failures)\n"
               "raise SystemExit(1 if failures else 0)\n")
    result = run_contained(program, trainer, mode)
    assert not (trainer.directory / "pwned.txt").exists()
    if mode == MODES["guard-only"]:
        assert result.reason == f"write outside sandbox: {trainer.directory / 'pwned.txt'}"
    elif mode["audit_guard"]:  # /tmp is the sandbox there: the trainer's path does not exist, '../..' is '/'
        assert result.reason == f"write outside sandbox: /{trainer.escape}"
    else:
        assert result.reason.startswith("exit status 1"), result.reason
        assert "Read-only file system" in result.stdout and "No such file" in result.stdout


def test_reading_the_trainers_files(trainer, mode):
    program = (f"print(open({str(trainer.directory / 'secret.txt')!r}).read())\n"
               f"print(open({os.path.abspath(__file__)!r}).read())\n")
    result = run_contained(program, trainer, mode)
    assert trainer.secret not in result.stdout + result.stderr
    if mode == MODES["guard-only"]:
        assert result.reason == f"read outside sandbox: {trainer.directory / 'secret.txt'}"
    else:  # the trainer's files do not exist in the namespace's root
        assert "FileNotFoundError" in result.reason


def test_opening_a_socket(trainer, mode):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    try:
        program = ("import socket\n"
                   f"connection = socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=1)\n"
                   "connection.sendall(b'leak')\n")
        result = run_contained(program, trainer, mode)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
    if mode["audit_guard"]:
        assert result.reason == "network blocked"
    elif mode["isolation"] == "bubblewrap":  # bwrap brings the new namespace's loopback up: nobody listens
        assert "ConnectionRefusedError" in result.reason, result.reason
    else:
        assert "unreachable" in result.reason, result.reason


def test_killing_the_parent(trainer, mode):
    program = ("import os, signal\n"
               "failures = []\n"
               f"for pid, number in (({os.getpid()}, signal.SIGUSR1), ({trainer.decoy.pid}, signal.SIGKILL),\n"
               "                    (os.getppid(), signal.SIGKILL)):\n"
               "    try:\n"
               "        os.kill(pid, number)\n"
               "    except OSError as error:\n"
               "        failures.append(repr(error))\n"
               "print(failures)\n"
               "raise SystemExit(1 if failures else 0)\n")
    result = run_contained(program, trainer, mode)
    time.sleep(0.1)  # a signal that got through would have been handled by now
    trainer.check_unharmed()
    if mode["audit_guard"]:
        assert result.reason == "signal to another process blocked"


def test_deleting_files(trainer, mode):
    program = ("import os, shutil\n"
               "open('mine.txt', 'w').close()\n"
               "os.remove('mine.txt')  # its own file: allowed\n"
               f"os.remove({str(trainer.directory / 'secret.txt')!r})\n"
               f"shutil.rmtree({str(trainer.directory)!r})\n")
    result = run_contained(program, trainer, mode)
    assert (trainer.directory / "secret.txt").read_text() == trainer.secret
    if mode == MODES["guard-only"]:
        assert result.reason == f"write outside sandbox: {trainer.directory / 'secret.txt'}"
    else:  # the trainer's files do not exist in the namespace's root
        assert "FileNotFoundError" in result.reason


def test_huge_output(trainer, mode):
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    result = run_contained(program, trainer, mode)
    assert result.reason == "output limit"
    assert len(result.stdout) + len(result.stderr) <= LIMITS.max_output_bytes


def test_never_reading_stdin(trainer, mode):
    program = "import time\ntime.sleep(60)\n"
    result = run_contained(program, trainer, mode, stdin="x" * (4 << 20))  # far more than a pipe holds
    assert result.reason == "timeout"


def test_filling_the_disk(trainer, mode):
    program = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (4 << 20))\n"
    assert run_contained(program, trainer, mode).reason == "file size limit"


def test_leaving_the_session(trainer, mode):
    # setsid puts a process out of reach of the process-group kill; the PID namespace still ends it.
    program = ("import os, time\n"
               "try:\n"
               "    os.setsid()\n"
               "except OSError:\n"
               "    pass  # already a session leader (the run without namespaces)\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "time.sleep(60)\n")
    result = run_contained(program, trainer, mode)
    assert result.reason == ("process creation blocked" if mode["audit_guard"] else "timeout")


# --- programs that should pass -------------------------------------------------------------------

HUMAN_EVAL_LIKE = '''
def add(a: int, b: int) -> int:
    """Return a + b."""
    return a + b


def check(candidate):
    assert candidate(2, 3) == 5
    assert candidate(-1, 1) == 0


check(add)
'''


def test_a_correct_solution_passes_and_a_wrong_one_fails(mode):
    result = run_program(HUMAN_EVAL_LIKE, "", ROOMY, **mode)
    assert result.passed and result.reason == "passed" and result.returncode == 0, result
    assert result.cleaned and not os.path.exists(result.workdir)
    wrong = run_program(HUMAN_EVAL_LIKE.replace("return a + b", "return a - b"), "", LIMITS, **mode)
    assert not wrong.passed and wrong.reason.startswith("exit status 1: AssertionError"), wrong.reason


def test_a_program_may_use_stdin_its_directory_and_a_thread(mode):
    program = ("import os, sys, threading, tempfile\n"
               "data = sys.stdin.read()\n"
               "with open('notes.txt', 'w') as f:\n"
               "    f.write(data)\n"
               "with tempfile.NamedTemporaryFile() as f:\n"
               "    f.write(b'scratch')\n"
               "worker = threading.Thread(target=lambda: None)\n"
               "worker.start(); worker.join()\n"
               "print(open('notes.txt').read().upper(), os.listdir('.'))\n")
    result = run_program(program, "hello\n" * 10000, ROOMY, **mode)
    assert result.passed, result
    assert result.stdout.startswith("HELLO\n") and "notes.txt" in result.stdout


def test_a_program_that_ignores_its_stdin_still_finishes_at_once(mode):
    result = run_program("print('done')\n", "x" * (4 << 20), LIMITS, **mode)
    assert result.passed and result.stdout == "done\n" and result.elapsed_s < LIMITS.wall_s


# --- bad input -------------------------------------------------------------------------------------

def test_bad_input_is_one_clear_error():
    with pytest.raises(UserError, match="source must be a str"):
        run_program(b"print(1)")
    with pytest.raises(UserError, match="wall_s must be a positive number"):
        SandboxLimits(wall_s=0)
    with pytest.raises(UserError, match="max_processes must be a positive integer"):
        SandboxLimits(max_processes=1.5)
    with pytest.raises(UserError, match="isolation must be one of"):
        run_program("print(1)", isolation="docker")
    with pytest.raises(UserError, match="audit_guard=False needs isolation='bubblewrap' or 'namespaces'"):
        run_program("print(1)", isolation="none", audit_guard=False)



FORGED_STATUS = """import os
for fd in range(3, 64):  # whichever is the status pipe
    try:
        os.write(fd, b"exit code 0\\ncompleted 0\\nstart 0\\n")
    except OSError:
        pass
os._exit({status})
"""


@pytest.mark.parametrize("early_exit, status", [
    ("import sys\nsys.exit(0)\n", 0), ("import os\nos._exit(0)\n", 0), ("raise SystemExit\n", 0),
    (FORGED_STATUS.format(status=0), 0), (FORGED_STATUS.format(status=1), 1)],
    ids=["sys.exit", "os._exit", "SystemExit", "forged status, exit 0", "forged status, exit 1"])
def test_exiting_before_the_tests_does_not_pass(mode, early_exit, status):
    # A wrong completion that ends the program before the appended tests run, or forges status lines.
    wrong = HUMAN_EVAL_LIKE.replace("return a + b", "return a - b")
    program = wrong.replace("\ncheck(add)", "\n" + early_exit + "\ncheck(add)")
    result = run_program(program, "", LIMITS, **mode)
    assert not result.passed and result.returncode == status, result
    assert result.reason == ("exited before the end of the program (status 0)" if status == 0 else "exit status 1")


# --- which path, and what the program is -----------------------------------------------------------

@pytest.mark.parametrize("isolation", ["bubblewrap", "namespaces"])
def test_the_program_runs_unprivileged(isolation):
    # The kernel layers alone: no capabilities, no way to regain them, and as root another uid
    # (RLIMIT_NPROC binds only then). Reads its own /proc, which each path mounts for it.
    skip_unless_available(isolation)
    program = ("import os\n"
               "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
               "print(os.getuid(), status['CapEff'].strip(), status['CapPrm'].strip(), "
               "status['NoNewPrivs'].strip(), os.getcwd(), sorted(os.listdir('/')))\n")
    result = run_program(program, "", ROOMY, isolation=isolation, audit_guard=False)
    assert result.passed, result
    uid, effective, permitted, no_new_privs, cwd, top = result.stdout.split(maxsplit=5)
    assert (int(uid) != 0) if os.geteuid() == 0 else (int(uid) == os.getuid()), result.stdout
    assert int(effective, 16) == 0 and int(permitted, 16) == 0 and no_new_privs == "1"
    assert cwd == "/sandbox"
    assert "'work'" not in top and "'home'" not in top and "'etc'" not in top, top  # no host paths


def test_auto_uses_bubblewrap_where_it_is_installed():
    skip_unless_available("bubblewrap")
    assert sandbox.selected_isolation() == "bubblewrap", sandbox.bubblewrap_probe()
    assert run_program("print('hi')\n", "", ROOMY).isolation == "bubblewrap"
    assert sandbox.isolation_report().startswith("sandbox: bubblewrap:")


def test_auto_falls_back_to_namespaces_without_bwrap(monkeypatch):
    skip_unless_available("namespaces")
    monkeypatch.setattr(sandbox_bwrap, "find_bwrap", lambda: None)
    sandbox.bubblewrap_probe.cache_clear()
    try:
        assert sandbox.selected_isolation() == "namespaces"
        result = run_program(HUMAN_EVAL_LIKE, "", ROOMY)
        assert result.passed and result.isolation == "namespaces", result
        assert "namespaces fallback (bubblewrap: bwrap is not installed" in sandbox.isolation_report()
        with pytest.raises(UserError, match="isolation='bubblewrap' needs bwrap"):
            run_program("print(1)", isolation="bubblewrap")
    finally:
        sandbox.bubblewrap_probe.cache_clear()  # the next test probes the real machine again


def wait_for_no_sandbox_process(seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    return sandbox_processes()


@pytest.mark.parametrize("isolation", ["bubblewrap", "namespaces"])
def test_a_caller_killed_at_any_moment_leaves_no_process(isolation):
    # A reward worker killed on its timeout may die while bwrap or the launcher is still setting
    # up, before any parent-death signal is armed. The launcher and the program must end on their
    # own (bwrap's path: the signal armed before exec, and PID 1's watch on the status pipe); a
    # bwrap child orphaned inside its own setup runs no code of ours, and the next run's sweep
    # kills it (module docstring).
    skip_unless_available(isolation)
    assert not sandbox_processes(), "a sandbox process was left over by an earlier test"
    bwrap = os.fsencode(sandbox_bwrap.find_bwrap() or "bwrap")
    for delay in (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5):
        caller = os.fork()
        if caller == 0:
            run_program("import time\ntime.sleep(60)\n", "", SandboxLimits(wall_s=30.0), isolation=isolation)
            os._exit(0)
        time.sleep(delay)
        os.kill(caller, signal.SIGKILL)
        os.waitpid(caller, 0)
        left = wait_for_no_sandbox_process(5.0)
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in left
                    if os.path.exists(f"/proc/{pid}")}
        if commands:
            print(delay, commands)  # shown with -s
        running = [pid for pid, command in commands.items() if command != bwrap]
        for pid in running:  # killed, so that one failure does not fail every later test
            os.kill(pid, signal.SIGKILL)
        assert not running, f"killed after {delay}s, the caller left {commands}"
        if left:
            run_program("print(1)\n", "", LIMITS, isolation=isolation)  # the sweep
            assert not wait_for_no_sandbox_process(2.0), "the next run's sweep left the killed run's bwrap"
    run_program("print(1)\n", "", LIMITS, isolation=isolation)  # its sweep removes the killed runs' directories
