"""
A/B comparison of the chat pipeline between revisions or settings, in one
run, so that a change is judged against its baseline under the same
machine conditions (absolute figures here drift by a third between runs).

    python bench/compare.py [--rounds 3] [--duration 8] [--connections 32]
                            [--rows chat,forward,stream] [--warmup 2] SPEC SPEC...

A SPEC is a git revision, or C{.} for the working tree, optionally followed
by C{:NAME=VALUE,...} for both daemons' environment: C{HEAD~1 .} compares
the last commit with the working tree, C{.:SVC_GRPC_WORKERS=4 .} a setting.
Each SPEC gets its own svc-auth and svc-proxy (a revision's code from a
temporary git worktree, first on their PYTHONPATH) on one shared
PostgreSQL, Redis and tenant. The rounds alternate the floor and every
SPEC; each line gives requests/s, p50, p99, the ratio to the floor of that
round, and per process the CPU time (and svc-proxy's reactor thread's, the
one that bounds what a proxy serves) and context switches per request, then
the cycle collector's collections per second and pauses in svc-proxy
during that row, by generation (svc_python_gc_pause_seconds).

--rows chat,forward also measures the forward row (the chat request
answered by a local nginx, as in bench/gateway.py), and stream the same
with "stream": true (nginx answering a fixed event stream);
forward-limits and forward-budget are bench/gateway.py's rows of the
same names (limits rows; a budget and a priced model), and so is
forward-recall (recall on, decisions D13: one svc-memory, shared by every
SPEC's proxy, holding the row's 1,000 memories; its CPU per request is
printed with the row's); messages, chat-to-anthropic, messages-to-openai
and each of those with -stream are the rows of Anthropic's dialect
(decisions D14) of bench/gateway.py, and forward-deployments and
forward-failing its rows of a model of three deployments (decisions D15);
--connections 1,32 measures every row, the floor included, at each count
in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway import (  # noqa: E402
    DEPLOYMENT_ROWS,
    DIALECT_ROWS,
    cpuSeconds,
    gcCells,
    gcDuring,
    gcPauses,
    reactorCPUSeconds,
    runningStack,
    runWrk,
    summarize,
)

from svcd.devkit.daemons import Daemon, authEnvironment  # noqa: E402
from svcd.devkit.servers import freePort  # noqa: E402

# The rows forwarded to nginx (bench/gateway.py says what each is).
FORWARDED = (
    "forward",
    "stream",
    "forward-limits",
    "forward-budget",
    "forward-recall",
    *DIALECT_ROWS,
    *DEPLOYMENT_ROWS,
)
# Wide enough for the longest row's name (chat-to-anthropic-stream).
ROW_WIDTH = max(len(row) for row in FORWARDED)


@attrs.frozen
class Spec:
    label: str
    revision: str
    environment: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Spec:
        revision, _, assignments = text.partition(":")
        environment = {}
        for pair in filter(None, assignments.split(",")):
            name, equals, value = pair.partition("=")
            if not equals:
                raise SystemExit(f"expected NAME=VALUE in {text!r}")
            environment[name] = value
        return cls(text, revision or ".", environment)


def contextSwitches(pid: int) -> int:
    """
    Voluntary and involuntary context switches of all threads of C{pid}.
    """
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches" in line:
                    total += int(line.split()[1])
    return total


def checkout(stack: contextlib.ExitStack, revision: str, scratch: Path) -> str | None:
    """
    The directory whose code the daemons of C{revision} run: None for the
    working tree, else a temporary worktree of that revision.
    """
    if revision == ".":
        return None
    tree = Path(tempfile.mkdtemp(dir=scratch, prefix="tree-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), revision],
        check=True,
    )
    stack.callback(
        subprocess.run,
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
        check=False,
    )
    return str(tree)


def _measureSpec(
    spec: Spec,
    row: str,
    auth: Daemon,
    proxy: Daemon,
    connections: int,
    path: str,
    environment: dict[str, str],
    expected: int,
    floor: dict[str, float],
    duration: float,
    memory: Daemon | None = None,
) -> dict[str, dict[str, Any]]:
    """
    One row of one SPEC (its requests to C{path}): wrk, then a line with
    its figures; returns what the cycle collector did meanwhile
    (L{gcDuring}). C{memory}: svc-memory, whose CPU the row's recalls
    cost too.
    """
    pids = {"svc-auth": auth.process.pid, "svc-proxy": proxy.process.pid}  # type: ignore[union-attr]
    if memory is not None:
        pids["svc-memory"] = memory.process.pid  # type: ignore[union-attr]
    cpu = {name: cpuSeconds(pid) for name, pid in pids.items()}
    reactorCPU = reactorCPUSeconds(pids["svc-proxy"])
    switches = {name: contextSwitches(pid) for name, pid in pids.items()}
    pauses = gcPauses([proxy])
    raw = runWrk(proxy.url(path), connections, duration, environment)
    collector = gcDuring(pauses, gcPauses([proxy]), raw["duration_us"] / 1e6)
    result = summarize(row, connections, expected, raw)
    requests = max(1, raw["requests"])
    reactorCost = (reactorCPUSeconds(pids["svc-proxy"]) - reactorCPU) / requests * 1e6
    costs = " ".join(
        f"{name} {(cpuSeconds(pid) - cpu[name]) / requests * 1e6:.0f} µs"
        + (f" (reactor thread {reactorCost:.0f})" if name == "svc-proxy" else "")
        + f" {(contextSwitches(pid) - switches[name]) / requests:.1f} cs"
        for name, pid in pids.items()
    )
    print(
        f"  {spec.label:<24} {row:<{ROW_WIDTH}} {result['rps']:7.0f} req/s"
        f" {result['rps'] / floor['rps']:6.1%} of floor"
        f"  p50 {result['p50_ms']:6.2f} p99 {result['p99_ms']:6.2f} ms"
        f"  errors {result['errors']}  {costs}",
        flush=True,
    )
    if result["errors"]:
        print(f"  {'':<24} {'':<{ROW_WIDTH}} statuses {result['statuses']}", flush=True)
    print(f"  {'':<24} {'':<{ROW_WIDTH}} {gcCells(collector)}", flush=True)
    return collector


def _printHistograms(
    histograms: dict[tuple[str, str, int, str], list[tuple[float, float]]], seconds: float
) -> None:
    """
    The pauses of every SPEC, row and connection count over all rounds:
    collections by bucket (the upper bound, in ms; not cumulative).
    """
    bounds = next((buckets for buckets in histograms.values() if buckets), [])
    print(
        "svc-proxy's collections by pause (ms, up to), all rounds"
        f" ({seconds:.0f} s per SPEC and row):"
    )
    header = " ".join(
        f"{'+Inf' if bound == float('inf') else f'{bound * 1000:g}':>6}" for bound, _ in bounds
    )
    print(f"  {'SPEC':<24} {'row':<{ROW_WIDTH}} {'conns':>5} gen {header}")
    for (label, row, connections, generation), buckets in histograms.items():
        if not buckets:
            # A revision that does not export svc_python_gc_pause_seconds.
            continue
        counts, below = [], 0.0
        for _, cumulative in buckets:
            counts.append(cumulative - below)
            below = cumulative
        cells = " ".join(f"{count:>6.0f}" for count in counts)
        print(f"  {label:<24} {row:<{ROW_WIDTH}} {connections:>5} {generation:>3} {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="+", metavar="SPEC")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--connections", default="32", help="comma-separated, e.g. 1,32")
    parser.add_argument("--rows", default="chat", help="chat, forward, stream, comma-separated")
    parser.add_argument(
        "--warmup", type=float, default=2.0, help="seconds of load on each SPEC before round 1"
    )
    arguments = parser.parse_args()
    rows = [row.strip() for row in arguments.rows.split(",") if row.strip()]
    if not rows or set(rows) - {"chat", *FORWARDED}:
        raise SystemExit(
            "compare.py: --rows takes chat, forward, stream, forward-limits,"
            " forward-budget, forward-recall, messages, chat-to-anthropic,"
            " messages-to-openai and each of those three with -stream,"
            " forward-deployments, forward-failing,"
            f" got {arguments.rows!r}"
        )
    specs = [Spec.parse(each) for each in arguments.specs]
    connectionCounts = [int(each) for each in arguments.connections.split(",")]
    for spec in specs:
        if (
            spec.revision != "."
            and subprocess.run(
                [
                    "git",
                    "-C",
                    str(ROOT),
                    "rev-parse",
                    "--quiet",
                    "--verify",
                    f"{spec.revision}^{{commit}}",
                ],
                capture_output=True,
            ).returncode
        ):
            raise SystemExit(f"compare.py: not a revision of this repository: {spec.revision}")

    with (
        tempfile.TemporaryDirectory(prefix="svc-compare-") as scratchName,
        contextlib.ExitStack() as stack,
    ):
        scratch = Path(scratchName)
        shared = stack.enter_context(
            runningStack(
                scratch,
                "INFO",
                [1],
                withForwarding=bool(set(FORWARDED) & set(rows)),
                withMemory="forward-recall" in rows,
                withDialects=bool(set(DIALECT_ROWS) & set(rows)),
            )
        )
        base = shared.proxies[1, False][0]
        dsn = shared.auth.environment["POSTGRES_DSN"]
        served = []
        for index, spec in enumerate(specs):
            tree = checkout(stack, spec.revision, scratch)
            extra = dict(spec.environment)
            if tree is not None:
                extra["PYTHONPATH"] = os.pathsep.join(
                    filter(None, [tree, os.environ.get("PYTHONPATH")])
                )
            auth = Daemon(
                "svc-auth",
                authEnvironment(dsn, **extra),
                scratch / f"auth-{index}.log",
            ).start()
            stack.callback(auth.terminate)
            auth.waitForReady()
            proxy = Daemon(
                "svc-proxy",
                {
                    "SVC_HOST": "127.0.0.1",
                    "SVC_PORT": str(freePort()),
                    "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
                    "REDIS_URL": base.environment["REDIS_URL"],
                    "SVC_RATE_LIMIT_ORG_OVERRIDES": base.environment[
                        "SVC_RATE_LIMIT_ORG_OVERRIDES"
                    ],
                    **{
                        name: base.environment[name]
                        for name in ("SVC_PROVIDERS_FILE", "SVC_MEMORY_GRPC_ADDR")
                        if name in base.environment
                    },
                    **extra,
                },
                scratch / f"proxy-{index}.log",
            ).start()
            stack.callback(proxy.terminate)
            proxy.waitForReady()
            served.append((spec, auth, proxy))

        # Each row's path (the messages rows' is /v1/messages), the wrk
        # script's environment and the expected status.
        shapes = {
            row: (urlsplit(url).path, environment, expected)
            for row in rows
            for url, environment, expected in [shared.shape(row, 1)]
        }
        floorURL = f"{shared.floorURL}/v1/chat/completions"
        _, floorEnvironment, _ = shared.shape("floor", 1)
        if arguments.warmup:
            # Fill each svc-auth's cache and thread pool before measuring.
            for _, _, proxy in served:
                for path, environment, _ in shapes.values():
                    runWrk(proxy.url(path), max(connectionCounts), arguments.warmup, environment)
        histograms: dict[tuple[str, str, int, str], list[tuple[float, float]]] = {}
        for number in range(1, arguments.rounds + 1):
            for connections in connectionCounts:
                floor = summarize(
                    "floor",
                    connections,
                    501,
                    runWrk(floorURL, connections, arguments.duration, floorEnvironment),
                )
                print(
                    f"round {number}, {connections} connection(s): floor {floor['rps']:.0f}"
                    f" req/s  p50 {floor['p50_ms']:6.2f} p99 {floor['p99_ms']:6.2f} ms",
                    flush=True,
                )
                for spec, auth, proxy in served:
                    for row, (path, environment, expected) in shapes.items():
                        collector = _measureSpec(
                            spec,
                            row,
                            auth,
                            proxy,
                            connections,
                            path,
                            environment,
                            expected,
                            floor,
                            arguments.duration,
                            shared.memory if row == "forward-recall" else None,
                        )
                        for generation, each in collector.items():
                            key = (spec.label, row, connections, generation)
                            summed = histograms.setdefault(key, [])
                            histograms[key] = [
                                (bound, count + (summed[index][1] if summed else 0.0))
                                for index, (bound, count) in enumerate(each["buckets"])
                            ]
    _printHistograms(histograms, arguments.duration * arguments.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
