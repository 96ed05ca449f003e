"""
A scripted upstream for the tests: a real HTTP server on a loopback port
that answers C{POST .../chat/completions} the way an OpenAI-compatible
provider does (JSON answers, chunked server-sent events, OpenAI-shaped
errors) and C{POST .../messages} the way Anthropic does (decisions D14;
see "Anthropic's Messages API" below), or misbehaves in exactly the way a
test asks for.

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
  - C{POST <any prefix>/messages} and C{POST <any prefix>/messages/count_tokens}:
    Anthropic's Messages API, with the same grammar of C{model} (see
    "Anthropic's Messages API").
  - C{GET <any prefix>/models}: the OpenAI list shape, naming a few models
    of the grammar.
  - Anything else: 404 (or 405 for a known path with another method) with
    an OpenAI-shaped error.

With C{--api-key KEY}, every API request whose C{Authorization} is not
C{Bearer KEY} gets 401 C{invalid_api_key}, before any script runs (on
Anthropic's routes, one with neither C{x-api-key: KEY} nor that
C{Authorization}: 401 C{authentication_error}).

Every answer carries C{x-request-id: req_scripted_<n>}, as OpenAI's do
(Anthropic's routes: C{request-id}, as Anthropic's do), so a test can check
that the gateway does not pass the upstream's id on.

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
  - C{error-mid-stream} (or C{error-mid-stream:<code>}, 400..599; default
    529): a stream of the role event and two content events, then the
    provider's own error event for that status, and the end of the answer
    (a whole one, with its terminating chunk): OpenAI's C{data: {"error":
    {"message", "type", "param", "code"}}} (no C{[DONE]}), or Anthropic's
    C{error} event (C{overloaded_error} for 529). Non-streaming: as
    C{status:<code>}.
  - C{tool-call} (or C{tool-call:<name>}): the answer calls a tool (see
    "Tool calls").

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
  - C{cache:<reads>:<writes>}: of the prompt's tokens (the echo's, or
    C{usage}'s, or C{usage-at-cap}'s), that many were read from the
    provider's prompt cache and written to it: each at most what is left
    of the prompt, reads first (so C{usage-at-cap+cache:0:999999999}
    makes the whole prompt cache writes). Anthropic's usage says
    C{cache_read_input_tokens} and C{cache_creation_input_tokens}, its
    C{input_tokens} the rest; OpenAI's C{prompt_tokens} stays the whole
    prompt, with C{prompt_tokens_details.cached_tokens} (reads) and
    C{prompt_tokens_details.cache_write_tokens} (writes), the shape of
    decisions D14. Not with C{no-usage}, nor with C{usage}'s own
    C{<cached>} count (which, on Anthropic's routes, is its cache reads).

Tool calls
==========

C{tool-call} answers with one call of a tool: the one C{tool-call:<name>}
names, else the one the request's C{tool_choice} names, else the first of
its C{tools} (OpenAI's C{{"function": {"name"}}} or Anthropic's
C{{"name"}}); a request offering none is a 400. Its arguments are the JSON
object C{{"text": <the text of the last message>}}; its id
C{call_scripted_<n>} (OpenAI) or C{toolu_scripted_<n>} (Anthropic), C{n}
the request's number in the log. OpenAI: C{content} null, one
C{tool_calls} entry, C{finish_reason} C{tool_calls}; streamed, a first
chunk with the role, the call's id, name and empty arguments, then the
arguments in three pieces, then the finish chunk. Anthropic: one
C{tool_use} block, C{stop_reason} C{tool_use}; streamed, its
C{content_block_start} (C{input} empty), C{ping}, an empty
C{input_json_delta} then the arguments in three pieces. The completion
tokens are the words of the arguments' JSON.

When the conversation's last turn is a tool's result (OpenAI's C{tool}
message, or an Anthropic user turn with a C{tool_result} block), the
answer is the C{echo} instead, so that an agent's loop ends: a test can
send the call's result back with the same model.

Anthropic's Messages API
========================

C{POST <prefix>/messages} answers as Anthropic does (the C{anthropic} SDK
is pointed at C{ScriptedUpstream.anthropicBaseURL}; a provider's
C{base_url} is C{baseURL}, with C{/v1}). Before any script: with a key,
C{x-api-key} must be it, or C{Authorization} C{Bearer} it (what the
C{anthropic} SDK sends; 401 C{authentication_error}, "x-api-key header is
required" or "invalid x-api-key"); C{anthropic-version} must be
present (400); the body must be a JSON object with a string C{model}, a
C{messages} list and a whole C{max_tokens} of at least 1 (400
C{invalid_request_error} naming the field). The log keeps every header, so
a test reads the C{anthropic-version} and C{anthropic-beta} that were
forwarded with C{RecordedRequest.header}.

  - Errors: C{{"type": "error", "error": {"type", "message"},
    "request_id"}}, the type by status: 400 C{invalid_request_error}, 401
    C{authentication_error}, 402 C{billing_error}, 403
    C{permission_error}, 404 C{not_found_error}, 413
    C{request_too_large}, 429 C{rate_limit_error} (with C{status:429}'s
    Retry-After), 500 C{api_error}, 504 C{timeout_error}, 529
    C{overloaded_error}; another 4xx C{invalid_request_error}, another 5xx
    C{api_error}.
  - C{echo}: a C{message} (C{id} C{msg_scripted_<n>}) whose one text
    block says C{"Scripted answer to <m> messages; the last has <c>
    characters."}, where the C{system} prompt, when it has text, counts as
    one more message before the others (so a conversation is echoed alike
    in both dialects); input tokens are the words of the system prompt and
    of every turn's text (text blocks, and the text of C{tool_result}
    blocks), output tokens the words of the answer. As Anthropic ends an
    answer: it is cut before the first of the request's C{stop_sequences}
    it holds (C{stop_reason} C{stop_sequence}, C{stop_sequence} the one
    found), else after C{max_tokens} words (C{max_tokens}), else it is
    whole (C{end_turn}); other kinds of answer are never cut.
  - C{usage}: C{input_tokens}, C{cache_creation_input_tokens},
    C{cache_read_input_tokens} (see C{cache}), C{cache_creation}
    (C{ephemeral_5m_input_tokens}: the writes, C{ephemeral_1h_input_tokens}:
    0), C{output_tokens}, C{service_tier} C{standard}.
    C{usage:<prompt>:<completion>} makes C{prompt} the sum of the three
    input counts; C{no-usage} leaves C{usage} out of the message and of
    the events (which Anthropic never does).
  - With C{"stream": true}: C{text/event-stream; charset=utf-8}, each event
    C{event: <type>} then C{data: <JSON>}, in Anthropic's order:
    C{message_start} (the message with no content, no stop reason, the
    input usage and C{output_tokens} 1), C{content_block_start} (index 0),
    C{ping}, one C{content_block_delta} (C{text_delta}) per word, with the
    space after it, C{content_block_stop}, C{message_delta} (the stop
    reason and stop sequence, and C{usage} with C{output_tokens} only, the
    total), C{message_stop}. The first three are the opening events that
    C{close-mid-stream}, C{stall-stream} and C{error-mid-stream} count
    (where OpenAI's stream has its role chunk): C{close-mid-stream} closes
    after them and two deltas. C{not-json} streams one event,
    C{event: message_start} with C{data: this is not JSON}.
  - C{POST <prefix>/messages/count_tokens} (no C{max_tokens}) answers
    C{{"input_tokens": N}}, N the input tokens of the echo to the same
    body (C{usage}'s prompt when given; C{usage-at-cap}: the body's
    bytes). The delivery directives and faults apply as to a whole message
    (C{no-usage} and C{cache} change nothing); C{events}, C{bytes} and
    C{tool-call} are a 400.

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
C{prompt_tokens}), except C{events}, C{bytes}, C{tool-call},
C{error-mid-stream} and C{cache} (a 400). C{usage-at-cap}
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
    tool call, the extraction, the embedding of a text.
  - L{delivery}: how an answer is played out as its script says (delay,
    hold, gap, the faults, the stream and its backpressure), and the
    request log's record of it.
  - L{openai}: OpenAI's dialect, the shapes of its chat completions (whole
    and streamed), embeddings and errors.
  - L{anthropic}: Anthropic's dialect, the shapes of its messages (whole
    and streamed), token counts and errors.
  - L{resource}: the API port's routes and the control port's.
  - L{server}: the process (C{python -m svcd.devkit.upstream}).
  - L{client}: L{client.ScriptedUpstream}, which runs the process for a
    test, a benchmark or C{dev/gateway}, and reads its log.
"""

# The one address the server listens on, and where its clients reach it.
LOOPBACK = "127.0.0.1"
