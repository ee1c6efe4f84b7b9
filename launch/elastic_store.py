"""The rendezvous store of an elastic job (launch/elastic.sh), served by a process of its own.

    python3 launch/elastic_store.py --port 29400      # on a machine that stays up for the whole job

Every node's launch/elastic.sh connects to it (RDZV_ENDPOINT=<this machine>:29400) and none serves
it, so any node may leave the job: with torchrun's default, the first node's agent serves the
store, and when that node leaves, every other agent loses it and the job ends
(RendezvousConnectionError). --port 0 picks a free port. The first line printed names the port:
`rendezvous store on port 29400 (pid 4242): ...`.

Stop it (TERM or Ctrl-C) once the job has ended. One store per job: a job that ends closes its
rendezvous in the store for good, so a new job on a store kept running needs another RDZV_ID
(elastic.sh says so).

Security: the port has no authentication, and torchrun's agents unpickle what the store holds:
whoever reaches the port can run code on every node. Use trusted networks.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta


def parse_port(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Serve the rendezvous store of an elastic job.")
    parser.add_argument("--port", type=int, default=29400, help="TCP port to serve (0: a free one; default 29400)")
    port = parser.parse_args(argv).port
    if not 0 <= port <= 65535:
        parser.error(f"--port {port} is not a TCP port (0-65535)")
    return port


def serve(port: int) -> None:
    """Serves until TERM or INT. The signals are blocked before the store's threads start, so that
    sigwait, not a thread of the store, receives them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    from torch.distributed import TCPStore  # after the mask: torch's threads inherit it
    try:
        # wait_for_workers=False: clients come and go for the life of the job, none is awaited.
        store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    except RuntimeError as error:
        in_use = "EADDRINUSE" in str(error) or "address already in use" in str(error).lower()
        why = "is already in use (EADDRINUSE)" if in_use else f"cannot be served ({str(error).splitlines()[0]})"
        print(f"error: port {port} {why}; pass another --port, or --port 0 for a free one", file=sys.stderr)
        sys.exit(2)
    print(f"rendezvous store on port {store.port} (pid {os.getpid()}): start launch/elastic.sh on "
          f"each node with RDZV_ENDPOINT=<this host>:{store.port}; stop this with TERM or Ctrl-C once the job "
          "has ended", flush=True)
    received = signal.sigwait({signal.SIGTERM, signal.SIGINT})
    print(f"rendezvous store on port {store.port}: stopped by {signal.Signals(received).name}", flush=True)


if __name__ == "__main__":
    serve(parse_port(sys.argv[1:]))
