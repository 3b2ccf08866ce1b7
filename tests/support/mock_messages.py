"""A scripted stand-in for the Anthropic Messages API, on loopback only.

Claude Code in ``-p`` mode talks to ``$ANTHROPIC_BASE_URL/v1/messages``.  This
server answers that endpoint so the real binary runs offline and makes exactly
the tool calls a test asks for:

* The prompt carries the script: ``SCRIPT_MARKER`` followed by a JSON list of
  ``{"name": TOOL, "input": {...}}``.  The script travels inside the
  conversation, so one server serves any number of runs and needs no state
  between requests.
* Turn *n* of a conversation (``n`` = the number of ``tool_result`` blocks
  already sent back) gets scripted call *n* as a ``tool_use``; after the last
  one the reply is text that quotes the last tool result and ends the turn.
* A scripted tool that the request does not offer ends the turn with text
  starting ``MOCK-ERROR`` instead, so a test can tell "the tool was never
  offered" from "the tool was denied".
* Requests without a script (titles, warm-ups, anything else Claude Code may
  send) get a short text answer.

Both response shapes are served: server-sent events when the request says
``"stream": true``, one JSON message otherwise.  Every request body is kept in
``requests`` for diagnostics.  Stdlib only, one thread per connection.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SCRIPT_MARKER = "AGENTSANDBOX-MOCK-SCRIPT:"
MOCK_ERROR = "MOCK-ERROR"
FINAL_PREFIX = "MOCK-DONE"
MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class ToolCall:
    name: str
    input: Mapping[str, Any]

    def asJSON(self) -> dict[str, Any]:
        return {"name": self.name, "input": dict(self.input)}


def scriptPrompt(calls: Sequence[ToolCall], preface: str = "Run the scripted tool calls.") -> str:
    """The prompt text that makes the mock play ``calls`` in order."""
    return f"{preface}\n{SCRIPT_MARKER}{json.dumps([c.asJSON() for c in calls])}"


def _textOf(content: Any) -> list[str]:
    """Every text string in a message's ``content`` (a string or a list of blocks)."""
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping):
                if isinstance(block.get("text"), str):
                    texts.append(block["text"])
                if block.get("type") == "tool_result":
                    texts.extend(_textOf(block.get("content")))
    return texts


def findScript(messages: Sequence[Any]) -> list[ToolCall] | None:
    """The script in the first user message that carries one, if any."""
    decoder = json.JSONDecoder()
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        for text in _textOf(message.get("content")):
            at = text.find(SCRIPT_MARKER)
            if at < 0:
                continue
            raw, _ = decoder.raw_decode(text[at + len(SCRIPT_MARKER):])
            if not isinstance(raw, list):
                raise ValueError("the mock script must be a JSON list")
            calls = []
            for item in raw:
                if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                        and isinstance(item.get("input"), Mapping)):
                    raise ValueError(f"bad mock script entry: {item!r}")
                calls.append(ToolCall(item["name"], item["input"]))
            return calls
    return None


def toolResults(messages: Sequence[Any]) -> list[str]:
    """The text of every ``tool_result`` block, oldest first."""
    results: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "tool_result":
                results.append("\n".join(_textOf(block.get("content"))))
    return results


def offeredTools(body: Mapping[str, Any]) -> set[str]:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return set()
    return {t["name"] for t in tools if isinstance(t, Mapping) and isinstance(t.get("name"), str)}


@dataclass(frozen=True)
class Reply:
    """One assistant turn: either a tool call or text."""

    text: str | None = None
    toolCall: ToolCall | None = None
    toolUseId: str = ""

    @property
    def stopReason(self) -> str:
        return "tool_use" if self.toolCall else "end_turn"


def decide(body: Mapping[str, Any], toolUseId: str) -> Reply:
    """What the scripted model says next, given a request body."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return Reply(text=f"{MOCK_ERROR}: request has no messages list")
    try:
        script = findScript(messages)
    except ValueError as e:
        return Reply(text=f"{MOCK_ERROR}: {e}")
    if script is None:
        return Reply(text="ok")
    done = toolResults(messages)
    if len(done) < len(script):
        call = script[len(done)]
        offered = offeredTools(body)
        if call.name not in offered:
            return Reply(text=f"{MOCK_ERROR}: tool {call.name} not offered; offered: {sorted(offered)}")
        return Reply(toolCall=call, toolUseId=toolUseId)
    last = done[-1] if done else ""
    return Reply(text=f"{FINAL_PREFIX} after {len(done)} tool results; last: {last}")


def _contentBlock(reply: Reply) -> dict[str, Any]:
    if reply.toolCall is not None:
        return {"type": "tool_use", "id": reply.toolUseId, "name": reply.toolCall.name,
                "input": dict(reply.toolCall.input)}
    return {"type": "text", "text": reply.text or ""}


def jsonMessage(reply: Reply, model: str, messageId: str) -> dict[str, Any]:
    return {
        "id": messageId, "type": "message", "role": "assistant", "model": model,
        "content": [_contentBlock(reply)], "stop_reason": reply.stopReason,
        "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1},
    }


def sseEvents(reply: Reply, model: str, messageId: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The event stream of one turn, in the order the real API sends it."""
    yield "message_start", {"type": "message_start", "message": {
        "id": messageId, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1}}}
    if reply.toolCall is not None:
        start = {"type": "tool_use", "id": reply.toolUseId, "name": reply.toolCall.name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(dict(reply.toolCall.input))}
    else:
        start = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": reply.text or ""}
    yield "content_block_start", {"type": "content_block_start", "index": 0, "content_block": start}
    yield "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": reply.stopReason, "stop_sequence": None},
                            "usage": {"output_tokens": 1}}
    yield "message_stop", {"type": "message_stop"}


@dataclass
class MockMessagesAPI:
    """The server; ``start()`` binds 127.0.0.1 on a free port, ``stop()`` closes it."""

    host: str = "127.0.0.1"
    requests: list[dict[str, Any]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def port(self) -> int:
        assert self._server is not None, "the mock is not running"
        return int(self._server.server_address[1])

    @property
    def baseURL(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> MockMessagesAPI:
        if not self.host.startswith("127."):
            raise ValueError(f"the mock only listens on loopback, not {self.host}")
        self._server = ThreadingHTTPServer((self.host, 0), _handlerFor(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="mock-messages-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> MockMessagesAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def nextId(self) -> int:
        with self._lock:
            return next(self._ids)

    def record(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(body)


def _handlerFor(api: MockMessagesAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the recorded bodies are the log

        def _sendJSON(self, status: int, payload: Mapping[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, kind: str, message: str) -> None:
            self._sendJSON(status, {"type": "error", "error": {"type": kind, "message": message}})

        def do_GET(self) -> None:
            self._error(404, "not_found_error", f"mock serves POST /v1/messages only, not GET {self.path}")

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                self.close_connection = True
                self._error(400, "invalid_request_error", "bad Content-Length")
                return
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                self._error(400, "invalid_request_error", "body is not JSON")
                return
            if not isinstance(body, dict):
                self._error(400, "invalid_request_error", "body is not a JSON object")
                return
            if path == "/v1/messages/count_tokens":
                self._sendJSON(200, {"input_tokens": 1})
                return
            if path != "/v1/messages":
                self._error(404, "not_found_error", f"mock has no {path}")
                return
            api.record(body)
            n = api.nextId()
            reply = decide(body, toolUseId=f"toolu_mock{n:06d}")
            model = str(body.get("model", "mock-model"))
            messageId = f"msg_mock{n:06d}"
            if body.get("stream"):
                self._stream(reply, model, messageId)
            else:
                self._sendJSON(200, jsonMessage(reply, model, messageId))

        def _stream(self, reply: Reply, model: str, messageId: str) -> None:
            chunks = [f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                      for name, data in sseEvents(reply, model, messageId)]
            data = b"".join(chunks)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
