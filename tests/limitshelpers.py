"""
Helpers of the proxy's limits tests: a fake clock, a Redis counter and the
window they share (L{fakeClock}, L{counter}, L{WINDOW}, L{waitFor}), and the
ledger and budget book of the budget tests.

Moved here from test_proxy_ratelimit and test_proxy_limits so that the
modules that share them import a library rather than another test module.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock, deferLater

from svcd.devkit.redis import RedisServer
from svcd.devkit.rediscluster import RedisCluster
from svcd.limits.book import BudgetRow, LimitBook
from svcd.limits.keys import budgetPeriod
from svcd.limits.records import Budget

WINDOW = 1_700_000_040  # a calendar minute: a multiple of 60


async def waitFor(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {seconds} s")
        await deferLater(reactor, 0.02, lambda: None)


def fakeClock(at: float) -> Clock:
    clock = Clock()
    clock.advance(at)
    return clock


def counter(server: RedisServer, key: str) -> int:
    return int(server.command("INCRBY", key, "0")[1:])


ORG_ID = "5b0c1d2e-3f40-4a51-8b62-7c83d94ea5f6"


AGENT_ID = "0a1b2c3d-4e5f-4061-8273-94a5b6c7d8e9"


def redisCall(server: RedisServer | RedisCluster, *words: str | bytes) -> Any:
    """
    One command over a plain socket, with the reply read whole (RESP
    integers, simple and bulk strings, nil and arrays); to the master of
    its key when C{server} is a Redis Cluster (decisions D16).
    """
    encoded = [word.encode() if isinstance(word, str) else word for word in words]
    request = b"*%d\r\n" % len(encoded) + b"".join(
        b"$%d\r\n%s\r\n" % (len(word), word) for word in encoded
    )
    address = (
        server.addressFor(*encoded)
        if isinstance(server, RedisCluster)
        else (server.host, server.port)
    )
    with socket.create_connection(address, timeout=5) as connection:
        connection.sendall(request)
        reader = connection.makefile("rb")

        def read() -> Any:
            line = reader.readline().rstrip(b"\r\n")
            kind, rest = line[:1], line[1:]
            if kind == b":":
                return int(rest)
            if kind == b"+":
                return rest
            if kind == b"*":
                return [read() for _ in range(int(rest))]
            if kind == b"$":
                return None if rest == b"-1" else reader.read(int(rest) + 2)[:-2]
            raise AssertionError(f"unexpected reply {line!r}")

        return read()


def budgetBook(org: Budget | None = None, agent: Budget | None = None) -> LimitBook:
    book = LimitBook()
    book.replace([BudgetRow(ORG_ID, None, org), BudgetRow(ORG_ID, AGENT_ID, agent)])
    return book


# 2023-11-14T22:14:00Z, inside WINDOW's day.
DAY_START, DAY_END = budgetPeriod("day", WINDOW)
ORG_DAY = f"budget:{{{ORG_ID}}}:day:{DAY_START}"


class Ledger:
    """
    svc-auth's GetSpend, scripted: what each period has cost, and the
    questions asked.
    """

    def __init__(self, spent: int = 0, failing: bool = False) -> None:
        self.spent = spent
        self.failing = failing
        self.asked: list[tuple[str, str | None, int, int]] = []

    def __call__(self, orgID: str, agentID: str | None, since: int, until: int) -> Deferred[int]:
        self.asked.append((orgID, agentID, since, until))
        if self.failing:
            return fail(ConnectionError("svc-auth is away"))
        return succeed(self.spent)
