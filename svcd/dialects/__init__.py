"""
Translation between the two dialects clients and providers speak: OpenAI's
chat completions and Anthropic's Messages API (issue 46), both ways.

Pure code over parsed JSON: no reactor, no I/O, nothing of the proxy, so
that the routes (C{/v1/messages} to an OpenAI-compatible provider,
C{/v1/chat/completions} to an Anthropic one), the scripted upstream of the
tests and the benchmarks can all use it, and the tests can check every
field without a daemon.

  - L{svcd.dialects.requests}: request bodies, top-level fields;
    L{svcd.dialects.turns}: their conversations (messages, content blocks);
  - L{svcd.dialects.answers}: whole answers;
  - L{svcd.dialects.streams}: streamed answers, one event at a time;
  - L{svcd.dialects.usage}: token counts, with cache reads and writes;
  - L{svcd.dialects.errors}: what cannot be translated, and Anthropic's
    error envelope;
  - L{svcd.dialects.checks}: the shape of a C{/v1/messages} body.

A field with no counterpart in the other dialect raises
L{svcd.dialects.errors.Untranslatable} naming it (a dotted path), so that
the route answers 400 VALIDATION_ERROR and forwards nothing.
"""
