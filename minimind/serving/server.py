"""Running an app on uvicorn: `serve` (the `minimind-serve` command's server) and `serve_in_thread` (a loopback
server in a background thread, for benchmarks and tests), `release_openmp_workers`, which both call first, and
`is_loopback_host` (whether a host is reachable from this machine only)."""

from __future__ import annotations

import ipaddress
import threading
import time
from contextlib import contextmanager

from fastapi import FastAPI


def is_loopback_host(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only: 127.0.0.0/8, ::1 (also written
    [::1] or as ::ffff:127.x.y.z) or localhost. Anything else, a host name or an empty string included, may be
    reachable from other machines."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.dylib", "libiomp5.so")
OMP_PAUSE_HARD = 2


def release_openmp_workers() -> bool:
    """Gives back the OpenMP worker threads the calling thread keeps after any parallel torch op (the OpenMP 5.0
    call `omp_pause_resource_all`); they come back by themselves if it runs torch again. The server runs the model
    in its engine's thread, and while a thread that ran the model before (the compiled engine's warm-up, a
    benchmark's other rows) still holds a team of workers, GNU OpenMP (torch's on Linux) counts more threads than
    cores and stops its workers spinning between parallel regions, which slows every step down. Returns whether a
    loaded OpenMP runtime took the call."""
    import ctypes
    import os

    for name in OPENMP_RUNTIMES:
        try:  # only a runtime already loaded (torch's own copy), never a second one
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):
            continue
        pause = getattr(runtime, "omp_pause_resource_all", None)
        return pause is not None and pause(OMP_PAUSE_HARD) == 0
    return False


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    release_openmp_workers()  # from here on the model runs in the engine's thread
    uvicorn.run(app, host=host, port=port, log_level="info")


@contextmanager
def serve_in_thread(app: FastAPI, start_timeout: float = 60.0):
    """`app` on uvicorn at a free loopback port in a background thread, for benchmarks and tests; yields the base
    URL and stops the server on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    release_openmp_workers()  # the model runs in the engine's thread while this one waits for clients
    thread = threading.Thread(target=server.run, name="minimind-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        if thread.is_alive():
            raise RuntimeError("the server did not stop")
