"""Server processes the tests start on loopback: a free port, and a clean stop."""

import socket
import subprocess


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_server(proc: subprocess.Popen, timeout: float = 20):
    """SIGTERM, wait (SIGKILL past `timeout`), close the output pipe. Returns the exit status, None if killed."""
    proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
