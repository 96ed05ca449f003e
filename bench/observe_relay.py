"""
What observing a streamed chat completion costs the relay (decisions D13):
the real L{StreamRelay} relays streams of OpenAI chunks in memory, once
without C{onData} (a request that does not observe) and once feeding
L{AnswerText} (one that does), interleaved, in one run.

    python bench/observe_relay.py [--events 200] [--rounds 15] [--number 100]

Each figure is the best of C{--rounds} timings of C{--number} streams of
C{--events} chunks delivered in one read (the relay's work per byte is
then at its least, so the gathering's share is at its largest), the two
timed in turns; the ratio is taken within the run. Also the same with one chunk per read
(each event its own C{dataReceived}), as a slow provider sends them.
No network: what is measured is the relay's Python, not the sockets.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from twisted.internet.task import Clock  # noqa: E402

from svcd.providers.relay import StreamFault, StreamRelay  # noqa: E402
from svcd.proxy.observe import AnswerText  # noqa: E402

CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
    b'"model":"m","choices":[{"index":0,"delta":{"content":"word "},'
    b'"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"


def _errorEvent(fault: StreamFault) -> bytes:
    return b""


def relayOnce(reads: list[bytes], observe: bool) -> None:
    written: list[bytes] = []
    text = AnswerText() if observe else None
    relay = StreamRelay(
        Clock(),
        5,
        5,
        lambda: None,
        written.append,
        _errorEvent,
        False,
        text.addData if text is not None else None,
    )
    for read in reads:
        relay.dataReceived(read)
    assert relay.finished.called
    if text is not None:
        assert text.text()


def bestOfInterleaved(
    runs: tuple[Callable[[], None], Callable[[], None]], rounds: int, number: int
) -> tuple[float, float]:
    """
    The best time of one call of each of C{runs}, in seconds, timed in
    turns (one round of each, then again), so that a machine's drift
    touches both alike.
    """
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for run, timed in zip(runs, times, strict=True):
            timed.append(timeit.timeit(run, number=number) / number)
    return min(times[0]), min(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=100)
    arguments = parser.parse_args()
    shapes = {
        "one read": [CHUNK * arguments.events + DONE],
        "a read per event": [CHUNK] * arguments.events + [DONE],
    }
    print(f"{arguments.events} chunks per stream, best of {arguments.rounds} x {arguments.number}")
    for name, reads in shapes.items():
        plain, observed = bestOfInterleaved(
            (partial(relayOnce, reads, False), partial(relayOnce, reads, True)),
            arguments.rounds,
            arguments.number,
        )
        added = (observed - plain) / arguments.events
        print(
            f"{name:>17}: not observing {plain * 1e6:7.0f} us, observing"
            f" {observed * 1e6:7.0f} us (x{observed / plain:.2f}), {added * 1e6:.2f} us"
            " added per event"
        )


if __name__ == "__main__":
    main()
