"""The bubblewrap command line of the code-reward sandbox (``isolation="bubblewrap"``).

:mod:`logra_megatron.rl.sandbox` runs its launcher under ``bwrap`` (Debian's ``bubblewrap``)
when it is installed and a probe run works; this module only says how. The sandbox it asks for
is the one the namespaces fallback builds by hand (sandbox.py, layer 3):

- new PID, network, IPC, UTS and cgroup namespaces (plus a user namespace when the trainer is
  not root), named one by one: ``--unshare-all`` would add a user namespace as root too (see
  below); the network namespace has only a loopback interface, so nothing outside is reachable;
- a tmpfs root holding read-only binds of ``/usr``, ``/lib*``, ``/bin``, ``/sbin`` and the
  interpreter's prefix, the five harmless devices, a ``/proc`` of the new PID namespace, the
  launcher's four source files and the program under ``/launcher``, and ``/sandbox``: a tmpfs
  of at most ``disk_bytes`` (``--size``), the working directory, ``HOME`` and ``TMPDIR``
  (``/tmp`` links there). The root itself is remounted read-only last;
- the launcher is PID 1 (``--as-pid-1``): when it ends, the kernel kills the whole namespace;
  ``--die-with-parent`` ends it when the trainer's side of bwrap dies (armed late by bwrap:
  sandbox.py also arms bwrap's before exec and has the launcher watch its status pipe),
  ``--new-session`` keeps it off the trainer's terminal;
- as root, bwrap runs privileged without a user namespace (one would map the sandbox's uid to
  host root, which ``RLIMIT_NPROC`` ignores) and keeps only the capabilities the launcher needs
  to hand ``/sandbox`` to the sandbox uid and switch to it (which then clears them); otherwise
  the user namespace maps the trainer's uid to itself and bwrap drops every capability.

bwrap writes ``{"child-pid": N}`` (N: PID 1 of the namespace, as the trainer sees it) to
``info_fd``; the parent kills the namespace through that pid, as it does on the fallback.
"""

import os
import shutil
import sys
from typing import Optional

from logra_megatron.rl.sandbox import DEVICES, SANDBOX_DIR, SYSTEM_DIRECTORIES

LAUNCHER_DIR = "/launcher"
"""Where the launcher's sources and the program are bound, read-only, inside the sandbox."""
LAUNCHER_FILES = ("logra_megatron/__init__.py", "logra_megatron/errors.py", "logra_megatron/rl/__init__.py",
                  "logra_megatron/rl/sandbox.py")
"""What ``from logra_megatron.rl.sandbox import launch`` reads; nothing else of the package is bound."""
ROOT_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN")
"""Kept for the launcher when the trainer is root; switching to the sandbox uid clears them."""


def find_bwrap() -> Optional[str]:
    """The ``bwrap`` on PATH (or the usual places a minimal PATH leaves out), else None."""
    return shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


def interpreter() -> str:
    """The interpreter to run inside: the real file behind ``sys.executable`` (a venv's
    ``bin/python`` is a link the sandbox does not contain; ``-S`` needs only the prefix)."""
    return os.path.realpath(sys.executable)


def bwrap_command(bwrap: str, project_root: str, program_path: str, disk_bytes: int, info_fd: int,
                  as_root: bool) -> list:
    """The ``bwrap`` arguments up to ``--``; the caller appends the launcher's command line."""
    command = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--as-pid-1",
               "--info-fd", str(info_fd), "--cap-drop", "ALL"]
    if as_root:
        for capability in ROOT_CAPABILITIES:
            command += ["--cap-add", capability]
    else:
        command.append("--unshare-user")
    binds, bound = [], []  # (option, source, target)
    for source in _system_sources():
        if os.path.islink(source):
            binds.append(("--symlink", os.readlink(source), source))
        else:
            binds.append(("--ro-bind", source, source))
            bound.append(os.path.realpath(source))
    # After the system directories: a prefix under /usr is covered already, a link there is kept.
    for extra in (os.path.realpath(sys.base_prefix), interpreter()):
        if not any(extra == root or extra.startswith(root + "/") for root in bound):
            binds.append(("--ro-bind", extra, extra))
            bound.append(extra)
    binds += [("--dev-bind", device, device) for device in DEVICES if os.path.exists(device)]
    binds += [("--ro-bind", os.path.join(project_root, relative), f"{LAUNCHER_DIR}/{relative}")
              for relative in LAUNCHER_FILES]
    binds.append(("--ro-bind", program_path, f"{LAUNCHER_DIR}/program.py"))
    # bwrap creates missing parents of a target 0700 and root's: the sandbox uid could not reach
    # the interpreter under /root/.pyenv or the devices. Create them searchable first.
    for directory in _parents(target for _, _, target in binds):
        command += ["--perms", "0755", "--dir", directory]
    for bind in binds:
        command += list(bind)
    command += ["--proc", "/proc"]
    command += ["--perms", "0700", "--size", str(disk_bytes), "--tmpfs", SANDBOX_DIR,
                "--symlink", SANDBOX_DIR.lstrip("/"), "/tmp", "--chdir", SANDBOX_DIR,
                # Last: the root tmpfs read-only (not recursive, so /sandbox stays writable).
                "--remount-ro", "/"]
    return command


def _parents(targets) -> list:
    """Every directory above the targets, outermost first, each once."""
    parents = []
    for target in targets:
        parts = target.strip("/").split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            directory = "/" + "/".join(parts[:depth])
            if directory not in parents:
                parents.append(directory)
    return parents


def _system_sources() -> list:
    return [path for path in SYSTEM_DIRECTORIES if os.path.lexists(path)]
