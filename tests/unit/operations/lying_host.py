"""A compromised host of a prefetch: it reads what pdctl sends a host (the loader and the bundle,
then JSON lines, as pdctl/onhost/model_fetch.py's main() does) and answers as an attacker who
owns the host would: it claims what it likes and serves what it likes to the other hosts, which
run the real fetcher (tests/unit/operations/test_prefetch.py).

By environment:
  LIE_CLAIM     a file holding the file list it says its cache holds whole (a model prefetch)
  LIE_IMAGES    a file holding what it says it holds ({REF: {id, layers, size}}; images)
  LIE_RUNTIME   the runtime it says it runs (images; default podman)
  LIE_SERVE     what it answers every peer request with: "garbage" (the listed size, other
                bytes), "redirect:URL" (a 302 to URL)
"""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

sizes: dict[str, int] = {}
ordered = threading.Event()


class Liar(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        serve = os.environ.get("LIE_SERVE", "garbage")
        if serve.startswith("redirect:"):
            self.send_response(302)
            self.send_header("Location", serve.removeprefix("redirect:"))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        ordered.wait(30)
        size = sizes.get(self.path.rsplit("/", 1)[-1], 1 << 20)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        self.wfile.write(b"\0" * size)


def _json(variable: str) -> Any:
    path = os.environ.get(variable)
    return json.loads(Path(path).read_text()) if path else None


def main() -> int:
    stdin = sys.stdin.buffer
    for _frame in range(2):  # pdctl's loader and bundle: a compromised host runs its own code
        stdin.read(int(stdin.readline()))
    request = json.loads(stdin.readline())
    server = http.server.ThreadingHTTPServer((request["bind"], 0), Liar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    if request["op"] == "images":
        runtime = os.environ.get("LIE_RUNTIME", "podman")
        say({"event": "hello", "port": port, "runtime": runtime, "images": _json("LIE_IMAGES")})
        for line in iter(stdin.readline, b""):
            order = json.loads(line)
            if order.get("stop"):
                break
            say({"event": "failed", "image": order.get("take"), "message": "not today"})
        return 0
    claim = _json("LIE_CLAIM")
    say(
        {
            "event": "hello",
            "port": port,
            "commit": (claim or {}).get("commit"),
            "complete": claim is not None,
            "manifest": claim,
        }
    )
    order = json.loads(stdin.readline() or "null")
    if order:
        sizes.update({f["blob"]: f["size"] for f in order["manifest"]["files"]})
        ordered.set()
        total = sum(sizes.values())
        say({"event": "done", "bytes": total, "fetched": 0, "seconds": 0.1})
        stdin.readline()  # serve until pdctl says stop
    return 0


if __name__ == "__main__":
    sys.exit(main())
