"""Where Tessera's gRPC Unix sockets may live, and how a socket path is claimed.

The protocols on these sockets have no authentication: whoever can connect is trusted. So a
socket lives in a directory its owner alone controls, and the socket itself is 0600:

- ``ensure_private_dir`` creates the directory 0700, or checks an existing one: a directory
  owned by this process's user (or root, for the kubelet's device-plugin directory) that no
  one else may write into (and, for Tessera's own directories, not even enter).
- ``claim_socket_path`` frees the socket path for ``bind``: nothing there, or a stale socket
  left by a process that did not stop cleanly (removed). A live socket, a symbolic link or
  any other file is refused, never followed or deleted.
- ``restrict_socket`` makes a freshly bound socket 0600.
- ``rpc_failure`` says what a call on such a socket answered when it failed.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import grpc

from api.errors import InvalidInputError

PRIVATE_DIR_MODE = 0o700
SOCKET_MODE = 0o600


class UnsafeSocketPathError(InvalidInputError):
    """The socket path or its directory is not safe to serve on; the message says why."""


def ensure_private_dir(
    directory: Path, *, root_may_own: bool = False, others_may_enter: bool = False
) -> None:
    """Create ``directory`` (mode 0700) or check that an existing one is private.

    ``root_may_own``: a root-owned directory is accepted too (the kubelet's plugin dir).
    ``others_may_enter``: group/others may read and enter it, never write (the kubelet
    creates its plugin dir 0750 or 0755); otherwise it must grant them nothing.
    """
    try:
        st = directory.stat()
    except FileNotFoundError:
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
        except FileExistsError:
            pass  # created meanwhile by someone else: checked below like any existing one
        else:
            os.chmod(directory, PRIVATE_DIR_MODE)  # the umask may have taken bits away
            return
        st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketPathError(f"{directory} is not a directory; cannot put a socket in it")
    me = os.geteuid()
    if st.st_uid != me and not (root_may_own and st.st_uid == 0):
        raise UnsafeSocketPathError(
            f"{directory} is owned by uid {st.st_uid}, not by this process's uid {me}: its "
            "owner could replace the socket; use a directory of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    forbidden = 0o022 if others_may_enter else 0o077
    if mode & forbidden:
        what = "write to" if others_may_enter else "reach"
        raise UnsafeSocketPathError(
            f"{directory} has mode {mode:04o}: group or others may {what} it, and anyone who "
            "can connect to the socket is trusted; point the socket at a new subdirectory "
            f"(created {PRIVATE_DIR_MODE:04o}) or chmod {PRIVATE_DIR_MODE:o} {directory}"
        )


def claim_socket_path(path: Path) -> None:
    """Make ``path`` free for a new socket; refuse anything that is not a stale socket."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketPathError(
            f"{path} is a symbolic link, not a socket; it is neither followed nor removed: "
            "remove it or choose another path"
        )
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafeSocketPathError(
            f"{path} exists and is not a socket; it is not removed: remove it or choose "
            "another path"
        )
    if listening(path):
        raise UnsafeSocketPathError(
            f"{path}: another server is listening there; stop it or choose another path"
        )
    path.unlink(missing_ok=True)  # stale: left by a server that did not stop cleanly


def restrict_socket(path: Path) -> None:
    """Owner-only access (0600) to a socket just bound at ``path``."""
    os.chmod(path, SOCKET_MODE)


def listening(path: Path) -> bool:
    """Whether a server accepts connections on the Unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def is_socket(path: Path) -> bool:
    """``path`` itself (not a link's target) is a socket."""
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except FileNotFoundError:
        return False


def rpc_failure(e: grpc.RpcError) -> str:
    """``CODE: details`` of a failed call (its repr when it carries no status)."""
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else repr(e)
