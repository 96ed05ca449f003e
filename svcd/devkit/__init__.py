"""
What the first run needs: everything that puts the gateway, or a part of
it, on one machine with nothing installed but the packages dev/bootstrap
installs. C{dev/gateway}, the benchmarks of bench/ and the tests all stand
on it; nothing of the daemons imports it.

  - L{svcd.devkit.servers}, L{svcd.devkit.postgres}, L{svcd.devkit.redis}:
    private PostgreSQL and Redis servers on free loopback ports.
  - L{svcd.devkit.upstream}: the scripted model server, an
    OpenAI-compatible provider whose answers and faults the model name
    chooses (C{python -m svcd.devkit.upstream}).
  - L{svcd.devkit.daemons}: the svc daemons as twistd processes.
  - L{svcd.devkit.flood}: many keep-alive HTTP clients driven by one
    selector, for load.
  - L{svcd.devkit.gateway}: the whole gateway in the foreground, what
    C{dev/gateway} runs (C{python -m svcd.devkit.gateway}).

The test doubles (in-memory stand-ins for the daemons' collaborators) are
not here but in tests/, which alone uses them.
"""
