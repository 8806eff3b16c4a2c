"""pretune serve as a process (slow: two server starts): it listens where --host says, read from the kernel's
table of listening sockets; the key is enforced; Ctrl-C (SIGINT) stops it cleanly. Traffic goes to loopback only."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> set[str]:
    """Local addresses listening on ``port`` (IPv4), from /proc/net/tcp."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # 0A: LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def _start(args, port):
    proc = subprocess.Popen([sys.executable, "-m", "pretune", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("pretune serve did not start")


@pytest.mark.parametrize("host,key", [("127.0.0.1", None), ("0.0.0.0", "sesame")])
def test_serve_listens_where_asked(tiny_folders, host, key):
    port = _free_port()
    args = [str(tiny_folders[0]), "--host", host] + (["--api-key", key] if key else [])
    proc = _start(args, port)
    try:
        assert _listening(port) == {host}
        url = f"http://127.0.0.1:{port}/v1/models"
        if key:
            assert httpx.get(url).status_code == 401
            assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"] == "tiny"
        else:
            assert httpx.get(url, headers={"Authorization": "Bearer anything"}).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "pretune serve: interrupted (Ctrl-C)" in out, out  # the CLI's Ctrl-C exit
    assert "Application shutdown complete" in out and "Traceback" not in out
