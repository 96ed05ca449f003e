"""
The whole gateway on one machine, in the foreground: what C{dev/gateway}
runs.

It starts private PostgreSQL and Redis servers with their data in C{.data/}
of the checkout (unless POSTGRES_DSN or REDIS_URL name servers to use
instead), applies the migrations with C{svcctl migrate}, makes a demo
organization, agent and token once (remembered in C{.data/demo.json}),
runs C{twistd -n svc-auth} and C{twistd -n svc-proxy} as child processes
whose output goes straight to this terminal, waits until both report
ready, and prints curl commands that send a request through the gateway,
plain and streaming, in OpenAI's shape and in Anthropic's (C{/v1/messages},
decisions D14), and one command for each SDK (C{openai}, C{anthropic}).

Without C{SVC_PROVIDERS_FILE} in the environment it also runs the
project's scripted model server (L{svcd.devkit.upstream}) on a free
loopback port, writes C{.data/providers.toml} with three models answered
by it, the chat model C{demo}, the Claude-shaped chat model
C{demo-claude} of a provider of Anthropic's Messages API (decisions D14:
the server speaks both) and the embedding model C{demo-embed} (decisions
D13), with a C{[memory]} table naming C{demo-embed}, and gives
that file to svc-proxy alone: the printed commands then get a model's
answer, with usage, vectors, and a memory stored and found, on the first
run. Whenever the providers file has a C{[memory]} table, C{twistd -n
svc-memory} runs too, on the same database, and svc-proxy is given its
address, and so does C{twistd -n svc-worker}, which turns the observations
queued in svc-memory into memories; the demo agent then has recall and
observe on, so that the printed commands tell the gateway a fact and find
it recalled into the next answer. (Observe C{on}, not C{all}: only chats
that name their user, C{X-SVC-Memory-Subject}, are observed, as the
printed commands do; decisions D13 amended, "Whose words".) With
C{SVC_PROVIDERS_FILE} set (even empty: no provider, every chat request
answers 501), svc-proxy gets the variable as it is and no model server
runs. The daemons themselves never assume a providers file (decisions D9).

Ctrl-C, SIGTERM or a closed terminal stops the daemons (SIGTERM, then
SIGKILL after 15 s), the model server and the servers it started, and
exits 0. If one of them dies on its own, everything else is stopped and
the exit status is 1.

No reactor runs here: this process only starts, watches and stops others,
so plain subprocesses and polling keep it simple.

Where it is written: L{command} is the command line (C{python -m
svcd.devkit.gateway}, signals, the exit status), L{settings} what the
developer asked for, L{stack} the run itself (L{stack.DevStack}: servers,
model server, daemons, readiness, the stop), L{demo} the demo tenant and
the commands printed to try it, L{children} what they share (the lines we
print, svcctl, the record of the children for the next run).
"""
