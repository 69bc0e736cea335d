"""The daemon `crossover bench soak` runs against (bench/soak.py's module doc, 1): its configuration,
and `crossover serve` started as a child process on a free loopback port, with what the audit
reads of it (RSS, descriptors, threads, child processes).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Note = Callable[[str], None]


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    """HTTP requests the soak phase sends in all (well-formed, hostile, bad, admin)."""
    well_formed: int = 400
    concurrency: int = 8
    hostile: int = 56
    engine_hostile: int = 4
    max_tokens: int = 24
    seed: int = 0
    fake: bool = False
    serve_args: tuple[str, ...] = ()
    tolerance: float = 0.05
    ttft_ratio: float = 3.0
    ready_timeout_s: float = 1800.0
    work_dir: str | None = None

    def check(self) -> None:
        for name, low in (("requests", 1), ("well_formed", 1), ("concurrency", 1), ("hostile", 0),
                          ("engine_hostile", 0), ("max_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if not 0 < self.tolerance < 1 or not self.ttft_ratio > 0:
            raise ValueError("--tolerance must be in (0, 1) and --ttft-ratio positive")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`crossover serve` as a child process, and what /proc says about it."""

    def __init__(self, work: Path, cfg: SoakConfig) -> None:
        self.port, self.token = free_port(), secrets.token_urlsafe(24)
        self.db_path, self.log_path = work / "soak.db", work / "daemon.log"
        token_file = work / "admin-token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        fake = ["--fake-engine", "--fake-step-ms", "5", "--fake-speculation"] if cfg.fake else []
        self.argv = [sys.executable, "-m", "cli.main", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--db", f"sqlite:///{self.db_path}",
                     "--admin-token-file", str(token_file), "--no-open", *fake, *cfg.serve_args]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin = {"Authorization": f"Bearer {self.token}"}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_bytes(self) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def fd_kinds(self) -> dict[str, int]:
        """Open descriptors by what they are: socket, pipe, anon_inode, or the file's path."""
        kinds: Counter = Counter()
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{self.proc.pid}/fd/{fd}")
            except OSError:
                continue
            kinds[target.split(":")[0] if target.split(":")[0] in ("socket", "pipe", "anon_inode")
                  else target] += 1
        return dict(kinds)

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def children(self) -> list[tuple[int, str]]:
        """(pid, command line) of the daemon's child processes."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0",
                                                                          b" ").decode(errors="replace")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                out.append((int(entry), cmd))
        return out

    def stop(self, timeout_s: float = 120.0) -> tuple[int | None, float]:
        """SIGTERM; (exit code or None when it had to be killed, seconds to exit)."""
        start = time.monotonic()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        self._log.close()
        return code, time.monotonic() - start
