"""Where a dev cluster lives: its settings (name, ports, dirs) and every file path it uses.

Defaults live here and nowhere else. A cluster's settings are saved in its state dir
(``cluster.json``) by ``up`` so that ``down``/``status``/``add-nodes`` find it by name alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from scheduler_plugins.core.gangs import PODGROUP_API
from scheduler_plugins.devtools.cluster.errors import ClusterError

DEFAULT_NAME: Final = "tessera"
DEFAULT_ETCD_PORT: Final = 2379
DEFAULT_APISERVER_PORT: Final = 6443
DEFAULT_KWOK_PORT: Final = 10247
LOOPBACK: Final = "127.0.0.1"
SERVICE_CIDR: Final = "10.96.0.0/16"
SERVICE_IP: Final = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` service
# Gangs (README "Gangs"): kube-scheduler 1.36's PodGroup API is alpha; the dev cluster's
# apiserver serves it and its tessera-scheduler schedules pod groups.
GANG_FEATURE_GATES: Final = "GenericWorkload=true,GangScheduling=true"
GANG_API: Final = PODGROUP_API

# Memory-backed storage (tmpfs) on Linux: what a machine keeps until it restarts.
SHM_DIR: Final = Path("/dev/shm")
_NAME_RE: Final = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
_SETTINGS_FILE: Final = "cluster.json"


def default_cache_dir() -> Path:
    """``$TESSERA_CACHE``, else ``~/.cache/tessera`` (the Makefile uses the same default)."""
    env = os.environ.get("TESSERA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tessera"


def repo_root() -> Path:
    """The checkout this package runs from; the cluster needs its ``hack/`` files."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "hack" / "build-tools.sh").is_file():
            return parent
    raise ClusterError(
        f"cannot find the Tessera checkout above {here} (no hack/build-tools.sh): the dev "
        "cluster runs from a source checkout; run it from there"
    )


def private_dir(path: Path) -> Path:
    """Make ``path`` (its parent must exist) open to this user only, or check that the one
    there is: a directory, not a link, this user's, closed to others. A shared directory
    such as /dev/shm lets anyone create the name first. Raises ``ClusterError``."""
    try:
        path.mkdir(mode=0o700)
        return path
    except FileExistsError:
        pass
    except OSError as e:
        raise ClusterError(f"cannot create {path}: {e.strerror or e}") from e
    if not is_private_dir(path):
        raise ClusterError(
            f"{path} exists but is not a private directory of this user (a link, a file, "
            "another user's, or open to others): remove it and start again"
        )
    return path


def is_private_dir(path: Path) -> bool:
    """``path`` is a directory (not a link) of this user, closed to others."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


@dataclass(frozen=True)
class ClusterSettings:
    """One dev cluster. Two clusters run side by side when names and all ports differ."""

    name: str = DEFAULT_NAME
    cache_dir: Path = field(default_factory=default_cache_dir)
    etcd_port: int = DEFAULT_ETCD_PORT
    etcd_peer_port: int = 0  # 0: etcd_port + 1
    apiserver_port: int = DEFAULT_APISERVER_PORT
    kwok_port: int = DEFAULT_KWOK_PORT
    state_dir_override: Path | None = None
    bin_dir_override: Path | None = None
    # A dev cluster is throwaway: etcd without fsync starts and writes much faster.
    etcd_fsync: bool = False

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ClusterError(
                f"cluster name {self.name!r} is invalid: use 1-40 lowercase letters, digits "
                "and '-', starting and ending with a letter or digit"
            )
        if self.etcd_peer_port == 0:
            object.__setattr__(self, "etcd_peer_port", self.etcd_port + 1)
        ports = {
            "etcd_port": self.etcd_port,
            "etcd_peer_port": self.etcd_peer_port,
            "apiserver_port": self.apiserver_port,
            "kwok_port": self.kwok_port,
        }
        for key, port in ports.items():
            if not 1 <= port <= 65535:
                raise ClusterError(f"{key} {port} is out of range 1-65535")
        if len(set(ports.values())) != len(ports):
            raise ClusterError(f"cluster ports must all differ, got {ports}")

    # Directories -------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.state_dir_override or self.cache_dir / "cluster" / self.name

    @property
    def bin_dir(self) -> Path:
        return self.bin_dir_override or self.cache_dir / "bin"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def etcd_data_dir(self) -> Path:
        return self.state_dir / "etcd"

    @property
    def memory_dir(self) -> Path:
        """State the cluster keeps in memory: its simulated GPUs' (MIG instances, MPS
        daemons), which outlives a node agent's restart, as a real GPU's does, and not the
        machine's. A directory on /dev/shm named for this user and state dir (``private_dir``
        makes it); the state dir's ``memory/`` where there is no /dev/shm this user may write.
        (On disk, the kwok node agent's state file rewrites, two per MIG pod, cost 0.15 of its
        1.2 ms per pod.) A 5000-node cluster's files take about 20 MiB there."""
        if not (SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK)):
            return self.state_dir / "memory"
        digest = hashlib.sha256(str(self.state_dir.absolute()).encode()).hexdigest()[:16]
        return SHM_DIR / f"tessera-{os.getuid()}-{digest}"

    @property
    def run_dir(self) -> Path:
        """Pid files."""
        return self.state_dir / "run"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    # Files -------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (token of a ``system:masters`` user)."""
        return self.state_dir / "kubeconfig"

    @property
    def kwok_kubeconfig(self) -> Path:
        return self.state_dir / "kwok.kubeconfig"

    @property
    def token_file(self) -> Path:
        return self.state_dir / "tokens.csv"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def pid_file(self, component: str) -> Path:
        return self.run_dir / f"{component}.pid"

    def log_file(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"

    # URLs --------------------------------------------------------------------------------

    @property
    def etcd_url(self) -> str:
        return f"http://{LOOPBACK}:{self.etcd_port}"

    @property
    def etcd_peer_url(self) -> str:
        return f"http://{LOOPBACK}:{self.etcd_peer_port}"

    @property
    def apiserver_url(self) -> str:
        return f"https://{LOOPBACK}:{self.apiserver_port}"

    @property
    def kwok_url(self) -> str:
        return f"http://{LOOPBACK}:{self.kwok_port}"

    # Persistence -------------------------------------------------------------------------

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        raw: dict[str, Any] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()
        }
        (self.state_dir / _SETTINGS_FILE).write_text(json.dumps(raw, indent=2) + "\n")

    @classmethod
    def load(cls, state_dir: Path) -> ClusterSettings:
        """Settings saved by ``up`` in ``state_dir``."""
        path = state_dir / _SETTINGS_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ClusterError(
                f"no cluster at {state_dir} ({path} missing): start one with `tessera cluster up`"
            ) from e
        except (OSError, ValueError) as e:
            raise ClusterError(f"cannot read {path}: {e}; remove {state_dir} and start over") from e
        try:
            return cls(
                name=str(raw["name"]),
                cache_dir=Path(raw["cache_dir"]),
                etcd_port=int(raw["etcd_port"]),
                etcd_peer_port=int(raw["etcd_peer_port"]),
                apiserver_port=int(raw["apiserver_port"]),
                kwok_port=int(raw["kwok_port"]),
                state_dir_override=_opt_path(raw.get("state_dir_override")),
                bin_dir_override=_opt_path(raw.get("bin_dir_override")),
                etcd_fsync=bool(raw.get("etcd_fsync", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ClusterError(
                f"{path} is malformed ({e!r}); remove {state_dir} and start over"
            ) from e

    def saved_or_self(self) -> ClusterSettings:
        """The saved settings of this cluster's state dir if any, else these."""
        if (self.state_dir / _SETTINGS_FILE).is_file():
            return ClusterSettings.load(self.state_dir)
        return self


def _opt_path(value: object) -> Path | None:
    return Path(str(value)) if value else None
