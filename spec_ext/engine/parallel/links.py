"""How the two sides of a parallel run talk: a thread link (queues in one process) or a
distributed link (pickled messages over torch.distributed send/recv)."""
from __future__ import annotations

import pickle
import queue
import sys
import threading
import traceback

import torch

from spec_ext.engine.parallel.messages import Failure, PeerError


def send_pickled(message, rank: int, group=None) -> None:
    """``message`` to ``rank``: its pickled size, then the bytes."""
    import torch.distributed as dist
    payload = pickle.dumps(message)
    dist.send(torch.tensor([len(payload)]), rank, group=group)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), rank, group=group)


class Link:
    def __init__(self, inbox: queue.Queue, timeout: float, peer: str):
        self.inbox, self.timeout, self.peer = inbox, timeout, peer

    def _check(self, message):
        if isinstance(message, Failure):
            raise PeerError(f"the {self.peer} side failed: {message.error} (no output is returned)")
        return message

    def get(self, wait_forever: bool = False):
        """The next message; PeerError after ``timeout`` seconds of silence (unless
        ``wait_forever``: a dead peer still raises, through the receiver)."""
        try:
            return self._check(self.inbox.get(timeout=None if wait_forever else self.timeout))
        except queue.Empty:
            raise PeerError(f"the {self.peer} side sent nothing for {self.timeout:g} s: it stalled or died "
                            f"(no output is returned){self.peer_location()}") from None

    def peer_location(self) -> str:
        return ""

    def poll(self) -> list:
        """Every message already here, without waiting."""
        messages = []
        while True:
            try:
                messages.append(self._check(self.inbox.get_nowait()))
            except queue.Empty:
                return messages


class ThreadLink(Link):
    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, timeout: float, peer: str):
        super().__init__(inbox, timeout, peer)
        self.outbox = outbox
        self.peer_thread: threading.Thread | None = None

    def peer_location(self) -> str:
        """Where the stalled peer thread is, for the error message."""
        frame = sys._current_frames().get(getattr(self.peer_thread, "ident", None))
        if frame is None:
            return ""
        return "; it was at:\n" + "".join(traceback.format_stack(frame)[-6:])

    def send(self, message) -> None:
        self.outbox.put(message)


class DistributedLink(Link):
    """Pickled messages over torch.distributed send/recv; a daemon thread receives into
    the inbox until a message of type ``last`` arrives (or the peer fails)."""

    def __init__(self, peer_rank: int, timeout: float, peer: str, last: tuple[type, ...] = (), group=None):
        super().__init__(queue.Queue(), timeout, peer)
        self.peer_rank, self.group, self.last = peer_rank, group, last
        threading.Thread(target=self._receive, daemon=True, name=f"spec_ext-recv-{peer}").start()

    def send(self, message) -> None:
        try:
            send_pickled(message, self.peer_rank, self.group)
        except Exception as error:  # noqa: BLE001 - any transport failure means the peer is gone
            raise PeerError(f"sending to the {self.peer} side (rank {self.peer_rank}) failed: {error}") from error

    def _receive(self) -> None:
        import torch.distributed as dist
        try:
            while True:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, self.peer_rank, group=self.group)
                data = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(data, self.peer_rank, group=self.group)
                message = pickle.loads(data.numpy().tobytes())
                self.inbox.put(message)
                if isinstance(message, self.last):
                    return
        except Exception as error:  # noqa: BLE001
            self.inbox.put(Failure(f"rank {self.peer_rank}: {type(error).__name__}: {error}"))
