"""Server processes the tests start on loopback: a free port, and a clean stop."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


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


def start_mars_server(ckpt, tmp, *flags, boot_timeout: float = 90):
    """`hf-mars serve CKPT` on a free loopback port, offline; returns (process, port) once /health answers."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp / "modules"), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    cli = Path(sys.executable).with_name("hf-mars")
    proc = subprocess.Popen([str(cli), "serve", str(ckpt), "--port", str(port), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + boot_timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            return proc, port
        except Exception:  # noqa: BLE001 - not listening yet
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail("hf-mars serve did not start:\n" + (proc.stdout.read() or "")[-3000:])
            time.sleep(0.3)


def save_checkpoint(model, tok, folder):
    """A served model as MARSTrainer would leave it (B = 4, marked trained), saved as a Hub checkpoint folder."""
    from hf_mars import save_for_hub
    from hf_mars.training.tokens import set_mars_metadata

    set_mars_metadata(model.config, block_size=4, trained_steps=1)
    return save_for_hub(model, tok, folder)
