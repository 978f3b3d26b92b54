"""Connected engines: one session per Session stream, with per-engine counters."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.errors import FailedPrecondition, Unauthenticated


@dataclass
class EngineCounters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0


@dataclass
class Session:
    id: str
    engine_name: str
    pid: int
    hostname: str
    peer: str
    connected_at: float
    namespaces: set[str] = field(default_factory=set)
    counters: EngineCounters = field(default_factory=EngineCounters)

    def require_namespace(self, namespace_id: str) -> None:
        if namespace_id not in self.namespaces:
            raise FailedPrecondition(f"namespace {namespace_id!r} is not registered in this session; call Register")


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def open(self, hello: pb.Hello, peer: str) -> Session:
        session = Session(
            id=uuid.uuid4().hex,
            engine_name=hello.engine_name,
            pid=hello.pid,
            hostname=hello.hostname,
            peer=peer,
            connected_at=time.time(),
        )
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise Unauthenticated(f"unknown session {session_id!r}; open a Session stream first")
        return session

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def engines_in(self, namespace_id: str) -> int:
        return sum(namespace_id in s.namespaces for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
