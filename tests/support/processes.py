"""What is running on this machine, read from /proc: a process's liveness and a process group's members (a local
engine's tree: it runs in a session of its own)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """The processes of a process group."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members
