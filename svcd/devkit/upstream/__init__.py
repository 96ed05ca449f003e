"""
A scripted OpenAI-compatible upstream for the tests: a real HTTP server on a
loopback port that answers C{POST .../chat/completions} the way a provider
does (JSON answers, chunked server-sent events, OpenAI-shaped errors), or
misbehaves in exactly the way a test asks for.

Why a separate process: the end-to-end tests drive the gateway with blocking
clients (the C{openai} SDK, urllib) from the test thread while the daemons
run as processes; an upstream running on the test's own reactor would not
answer while the test thread blocks. Run it as::

    python -m svcd.devkit.upstream --port 0 --port-file PATH [--api-key KEY]
        [--embedding-dimensions N]

It listens on 127.0.0.1 only, writes its ports to C{PATH} once listening
(JSON: C{{"port": API port, "controlPort": control port}}), logs nothing but
errors (on stderr) and stops on SIGTERM. L{client.ScriptedUpstream} runs it
for a test; tests/upstreamfixtures.py wraps that in the C{scriptedUpstream}
fixture.

Routes of the API port
======================

  - C{POST <any prefix>/chat/completions}: the scripted answer, chosen by
    the request body's C{model} (the grammar below). The prefix is free, so
    one server can stand for several providers: C{/v1/chat/completions} and
    C{/other/v1/chat/completions} behave alike, and the request log tells
    them apart by C{path}.
  - C{POST <any prefix>/embeddings}: OpenAI's embeddings answer (decisions
    D13; see "Embeddings" below), with the same grammar of C{model}.
  - C{GET <any prefix>/models}: the OpenAI list shape, naming a few models
    of the grammar.
  - Anything else: 404 (or 405 for a known path with another method) with
    an OpenAI-shaped error.

With C{--api-key KEY}, every API request whose C{Authorization} is not
C{Bearer KEY} gets 401 C{invalid_api_key}, before any script runs.

Every answer carries C{x-request-id: req_scripted_<n>}, as OpenAI's do, so a
test can check that the gateway does not pass the upstream's id on.

The grammar of C{model}
=======================

A model is one or more directives joined by C{+}, such as C{slow:300},
C{gap:50+events:20} or C{slow:200+status:503}. A model whose parts are not
all directives of this list (C{gpt-4o}, C{llama-3.1-8b}) is plain C{echo},
so a gateway forwarding real model names gets normal answers. A directive
of the list with a bad argument answers 400 saying what is wrong.

What the answer I{is} (at most one of these; C{echo} when none):

  - C{echo}: a normal answer whose content describes the request:
    C{"Scripted answer to <m> messages; the last has <c> characters."}.
    Non-streaming: a C{chat.completion} JSON with C{usage}. With
    C{"stream": true}: C{chat.completion.chunk} events, a first one with
    C{delta.role = "assistant"} and empty content, one content delta per
    word of the answer (their concatenation is the non-streaming content),
    a final one with C{finish_reason = "stop"}, then, only when the request
    has C{stream_options.include_usage: true}, a usage chunk with
    C{choices: []} (and C{"usage": null} on every other chunk, as OpenAI
    does), then C{data: [DONE]}. Usage: C{prompt_tokens} is the number of
    whitespace-separated words in the text of all messages,
    C{completion_tokens} the number of words of the answer.
  - C{status:<code>}: answers C{<code>} (400..599) with an OpenAI error
    body C{{"error": {"message", "type", "param", "code"}}}; the message is
    C{"Scripted error <code> for model '<model>'."}. C{status:429} also
    sends C{Retry-After: 7}; C{status:429:<seconds>} sends that value
    instead, or no Retry-After when it is 0.
  - C{close-mid-stream}: a stream of the role event and two content
    events, then the connection is closed with no terminating chunk (and
    no C{[DONE]}). Non-streaming: the headers with the full
    C{Content-Length} and half of the body, then the close. The close is a
    FIN once what was written has been sent, not a reset: a reset may make
    the reader's kernel drop data it has received and not yet read, and
    the test could not know whether the events arrived.
  - C{reset}: the connection is aborted (a TCP reset) before anything is
    answered.
  - C{never-ending}: a stream whose content events keep coming every
    100 ms (or C{gap}) forever. Non-streaming: 200 headers, then a body
    of JSON whitespace, one byte every 100 ms, forever (bytes keep coming,
    the answer never completes).
  - C{stall-stream}: the headers and the role event, then nothing, the
    connection held open. Non-streaming: the headers with the full
    C{Content-Length} and half of the body, then nothing.
  - C{events:<n>}: C{n} content events of about 300 bytes each, as fast as
    the connection takes them: the server is a push producer, so when the
    reader stops reading it stops writing once its kernel and transport
    buffers are full (about 64 KiB of its own plus the loopback socket
    buffers, which can hold megabytes). C{eventsSent} in the request log
    counts what was written so far, for backpressure tests.
    Non-streaming: one answer with the same content.
  - C{bytes:<n>}: an answer whose content is C{n} characters (the body is a
    little longer). Streaming: that content in deltas of 256 characters.
  - C{not-json}: 200 with C{Content-Type: application/json} and a body
    that is not JSON. Streaming: 200 C{text/event-stream} whose one event is
    C{data: this is not JSON}, then C{data: [DONE]}.

How it is delivered (any of these, with any of the above):

  - C{slow:<ms>}: wait that long before anything (headers, error, abort).
  - C{hold:<ms>}: send the 200 headers at once, then wait that long before
    the body or the first event, as a provider does that answers at once
    and then thinks (C{status}, C{reset} and C{not-json} ignore it).
  - C{gap:<ms>}: stream events that far apart (the first comes at once).
  - C{no-usage}: no C{usage} in the answer, and no usage chunk in a
    stream even when asked, as some providers do.
  - C{usage:<prompt>:<completion>}: the answer's usage says these counts
    instead of the echo's word counts (the content stays the echo's), as
    providers that give no details do (vLLM, for one).
    C{usage:<prompt>:<completion>:<cached>:<reasoning>} adds OpenAI's
    details: C{prompt_tokens_details.cached_tokens} (part of the prompt)
    and C{completion_tokens_details.reasoning_tokens} (part of the
    completion).
  - C{usage-at-cap}: the answer's usage says the most tokens the request
    allows, as the worst provider a budget must survive would (decisions
    D12, amended): C{prompt_tokens} is the request body's length in bytes
    (a byte-level tokenizer makes at most one token of a byte),
    C{completion_tokens} the request's output cap (C{max_completion_tokens}
    or C{max_tokens}, the larger when both are given) times its C{n}
    (default 1). A request without a cap (or with one that is not a whole
    number of at least 1) is answered 400, so a test can see that no cap
    was sent. The content stays the echo's.
  - C{usage-over-cap} (or C{usage-over-cap:<factor>}, 2 to 1000): as
    C{usage-at-cap}, with C{completion_tokens} that many times (default 2)
    more than the request allows: a provider that ignored its cap.

Extraction
==========

svc-worker's extraction request (decisions D13: C{"response_format":
{"type": "json_object"}}, the project's extraction prompt as the first
message, the conversation as JSON in the second) is answered, for C{echo},
with the content C{{"memories": [...]}}: each sentence of the user's turns
that says something of the user (it has a word of the first person
singular: I, me, my, ...) and is no question, in order, at most 20
(L{extractionContent}). The other kinds answer as usual (C{bytes:10} gives
an answer whose content is not the JSON asked for).

Embeddings
==========

C{POST .../embeddings} answers C{{"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens",
"total_tokens"}}}, one vector per input (C{input}: a string or an array
of strings; anything else is a 400), in order. The vectors are
deterministic and texts that share words are near: a hashed bag of words
(L{embeddingOf}: each word, lower-cased, adds +1 or -1 at a place of the
vector chosen by its hash), L2-normalised, so the cosine of two texts
grows with the words they share and is about 0 for texts that share none.
Their length is the request's C{dimensions} when it names one (1 to
L{MAX_EMBEDDING_DIMENSIONS}), else the server's C{--embedding-dimensions}
(default L{DEFAULT_EMBEDDING_DIMENSIONS}). C{"encoding_format": "base64"}
gives each vector as the base64 of its little-endian float32 values, as
OpenAI does; C{"float"} (the default) as numbers, the same float32 values.
C{prompt_tokens} is the number of whitespace-separated words of all the
inputs.

The directives of C{model} apply as they do to a non-streaming chat
completion (C{status}, C{reset}, C{slow}, C{hold}, C{not-json},
C{close-mid-stream}, C{stall-stream}, C{never-ending}, C{no-usage}, and
C{usage:<prompt>:<completion>}, whose prompt is the answer's
C{prompt_tokens}), except C{events} and C{bytes} (a 400). C{usage-at-cap}
makes C{prompt_tokens} the request body's length in bytes, the most a
byte-level tokenizer could count (an embedding has no cap), and
C{usage-over-cap:<factor>} that many times more. C{"stream": true} is
ignored: embeddings never stream.

C{vectors:<how>} (embeddings only; a chat completion naming it is a 400)
answers vectors a provider should never send: C{short} and C{long}, one
value fewer or more than the length asked for; C{huge}, the first value
1e39 (beyond float32) and C{nan}, the first value C{NaN}, both written as
JSON numbers whatever C{encoding_format} asked (a provider that ignored
it); C{infinity}, the first value an infinity (float32's in base64, else
the JSON token C{Infinity}).

Routes of the control port
==========================

The control routes live on a port of their own so that the tests' own
queries never show up in the connection counts or the request log.

  - C{GET /_upstream/requests}: the request log, a JSON list, oldest first,
    of every request the API port received. Each entry: C{number} (1, 2,
    ...), C{method}, C{path}, C{query}, C{headers} (C{[name, value]} pairs,
    names in lower case), C{body} (the parsed JSON, or null), C{bodyText}
    (the body as text when it is not JSON, else null), C{bodyLength},
    C{clientPort} (the peer's port: requests with the same value while it
    was open shared one connection), C{arrived} and C{ended} (monotonic
    times, see below; C{ended} is null while the answer is under way),
    C{outcome} (null while under way; C{"finished"} when the whole answer
    was written, C{"clientGone"} when the connection was lost before that,
    C{"aborted"} when the script closed or reset it), C{status} (the status
    answered, null before the headers) and C{eventsSent} (stream events
    written so far, C{[DONE]} included; 0 for answers that are no stream).
  - C{DELETE /_upstream/requests}: empties the log (numbering goes on).
  - C{GET /_upstream/connections}: C{{"open": n, "accepted": n}}, the TCP
    connections of the API port open now and accepted since the start.

The times are C{time.monotonic()} of the server process: on Linux that is
C{CLOCK_MONOTONIC}, one clock for every process of the machine, so a test
can compare them with its own C{time.monotonic()} (such as the time its
client went away against the C{ended} of the upstream request).

Where it is written
===================

  - L{script}: the grammar of C{model} (L{script.parseScript}).
  - L{content}: what an answer says, whatever its dialect: the echo, the
    extraction, the embedding of a text.
  - L{delivery}: how an answer is played out as its script says (delay,
    hold, gap, the faults, the stream and its backpressure), and the
    request log's record of it.
  - L{openai}: OpenAI's dialect, the shapes of its chat completions (whole
    and streamed), embeddings and errors. A second dialect is a module
    beside it, with its own L{delivery.Answer} and a route in L{resource}.
  - L{resource}: the API port's routes and the control port's.
  - L{server}: the process (C{python -m svcd.devkit.upstream}).
  - L{client}: L{client.ScriptedUpstream}, which runs the process for a
    test, a benchmark or C{dev/gateway}, and reads its log.
"""

# The one address the server listens on, and where its clients reach it.
LOOPBACK = "127.0.0.1"
