"""A fork server for the README test: `bdh-train ARGS` and `python FILE` in the README's blocks,
run by a real bash, are served by forks of one process that imported torch and bdh-train
once, so that each of the README's ~30 commands costs its own work and not an interpreter
start with a torch import (1-3 s each on 2 cores).

    python readme_shim.py serve SOCKET          # the server (the test starts it)
    python -S readme_shim.py bdh-train SOCKET ARGS...  # a client: the command line's argv
    python -S readme_shim.py python SOCKET FILE        # a client: a Python script

A client sends its working directory, its environment, its argv and its standard input,
output and error (the descriptors themselves) and exits with the command's status; the forked
child takes all of them over before it runs `bdh_train.cli.main(argv)` (or the script), so a
command sees what it would see as its own process. A run ends and counts its MFU as the
suite's in-process runs do (`helpers.short_run_end`: 8-token samples, no state-gain line;
`helpers.constant_peak`). The client imports only the standard library and runs without
`site` (-S): it starts in tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys

MAX_REQUEST = 1 << 20


def serve(path: str) -> None:
    """Answer requests on the Unix socket `path` until a request is `null`."""
    import matplotlib.backends.backend_agg  # noqa: F401  (each run draws loss.png)
    import matplotlib.figure  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401  (what the children share; no torch op runs before a fork)
    import torch._dynamo  # noqa: F401  (2 s of CPU in each train's first optimizer)
    from helpers import constant_peak, short_run_end  # tests/, this script's, is sys.path[0]

    import bdh_train.cli as cli
    import bdh_train.data.prepared  # noqa: F401
    import bdh_train.shared.loading  # noqa: F401
    import bdh_train.training.launch  # noqa: F401

    short_run_end(setattr)  # as the suite's in-process runs end: 8-token samples, no state gain
    constant_peak(setattr)  # and count their MFU: a constant peak, not four products a run

    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(4)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
            request = json.loads(message)
            if request is None:
                return
            pid = os.fork()
            if pid == 0:
                os._exit(_child(request, fds, cli.main))
            for fd in fds:
                os.close(fd)
            _, status = os.waitpid(pid, 0)
            conn.send(str(os.waitstatus_to_exitcode(status) % 256).encode())


def _child(request: dict, fds: list[int], main) -> int:  # type: ignore[no-untyped-def]
    """Become the command: its descriptors, directory and environment; run it; its status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    status = 0
    try:
        if request["kind"] == "python":
            sys.argv = argv
            code = compile(open(argv[0]).read(), argv[0], "exec")  # noqa: SIM115
            exec(code, {"__name__": "__main__", "__file__": argv[0]})  # noqa: S102
        else:
            sys.argv = ["bdh-train", *argv]
            status = main(argv) or 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return status


def call(kind: str, path: str, argv: list[str]) -> int:
    """Send one request (this process's directory, environment and descriptors 0-2) and
    return the status the command exited with."""
    request = {"kind": kind, "cwd": os.getcwd(), "env": dict(os.environ), "argv": argv}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        return int(conn.recv(16))


def stop(path: str) -> None:
    """Ask the server at `path` to exit."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(path)
        conn.send(b"null")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(call(sys.argv[1], sys.argv[2], sys.argv[3:]))
