"""``moto_server`` with DynamoDB's one-item atomicity: ``python -m loadtest.harness.moto_server``.

DynamoDB applies each request to an item atomically: a conditional write
checks its condition and writes in one step, so two racing writers can never
both pass. moto's server answers every request on its own thread, and its
DynamoDB backend reads, checks and writes with no lock between them: two
racing ``SET seq = :n IF seq < :n`` can both pass and leave the smaller
number. The tests and load tests race such writes on purpose (the presence
sequence, fences, claims), so they run moto behind this launcher, which lets
one DynamoDB request at a time into moto's backend. Other services (SQS long
polls, DynamoDB Streams) keep their own threads.

SQS loses messages the same way. moto's ``Queue.delete_message`` rebuilds the
queue's message list from the list it started reading and puts the copy back,
with no lock: a second delete that finishes meanwhile puts back its own copy,
a ``SendMessage`` appends to that one, and the first delete's copy then drops
the sent message (and brings the second delete's message back). Two nodes
deleting while the backend sends is the queue bridges' everyday traffic; the
queue bridge tests lost a few messages of one send now and then on a loaded
machine. The launcher holds the queue's own lock (the one its sends append
under) for each delete.

DynamoDB keeps HTTP/1.1 connections open between requests; werkzeug's server
under moto closes each after one response, so every request of a client paid
for a new TCP connection (a seventh of a node's CPU per ``UpdateItem`` in the
``connect`` load test), which no client of DynamoDB pays. The launcher keeps
them open: it reads each request's body before moto sees it, so no byte of one
request is left on the socket for the next (why werkzeug closes them).

moto keeps every model object it ever built in a list, for its dashboard
(``/moto-api/data.json``), and its ``UpdateItem`` builds a whole copy of the
item: an item updated n times left n copies behind. A ``GAMECOMMENTS`` item
with hundreds of comments made that hundreds of thousands of live objects, so
the collector's full passes stopped the server for half a second, growing with
every comment (the ``chat`` load test's p99). DynamoDB keeps no history of an
item; the launcher keeps moto's DynamoDB models out of that list. Each copy
still sends thousands of objects through the collector's generations, so its
full passes stay frequent: the launcher freezes the objects moto's start leaves
(modules, classes, some 60,000), which outlive every pass anyway, so a pass
walks only the items and requests (35 ms a pass became 13 here).

moto runs a PartiQL statement by turning every item of every table into JSON
and handing them all to its engine (``execute_statement``): 25 ``UPDATE``s of one
``BatchExecuteStatement`` took 13 s with 10,000 items in the server, where DynamoDB
touches the one item the ``WHERE`` names (an ``UPDATE`` must name a whole primary
key). The launcher shows an ``UPDATE`` whose ``WHERE`` names its table's key only
that item (or none); the engine, its conditions and the write are moto's own. Any
other statement runs as moto runs it.

Arguments are ``moto_server``'s (``-H``, ``-p``).
"""

from __future__ import annotations

import functools
import gc
import io
import threading
from typing import Any

import moto.server
from moto.core.model_instances import model_data
from moto.dynamodb.models import DynamoDBBackend
from moto.dynamodb.models.dynamo_type import DynamoType
from moto.dynamodb.models.table import Table
from moto.dynamodb.responses import DynamoHandler
from moto.moto_server.werkzeug_app import MotoRequestHandler
from moto.sqs.models import Queue

# moto's own parser of these statements (pinned with moto in constraints.txt).
from py_partiql_parser._internal.update_parser import (  # type: ignore[import-untyped]
    UpdateParser,
)
from werkzeug.serving import DechunkedInput

_one_request_at_a_time = threading.Lock()


def _serialise_dynamodb() -> None:
    unlocked = DynamoHandler.call_action

    @functools.wraps(unlocked)
    def call_action(self: DynamoHandler) -> Any:
        with _one_request_at_a_time:
            return unlocked(self)

    DynamoHandler.call_action = call_action  # type: ignore[method-assign]


def serialise_sqs_deletes() -> None:
    """Each SQS delete under its queue's lock (once, however often called: the tests
    call it in their own process)."""
    unlocked = Queue.delete_message
    if getattr(unlocked, "serialised", False):
        return

    @functools.wraps(unlocked)
    def delete_message(self: Queue, receipt_handle: str) -> None:
        with self._messages_lock:
            unlocked(self, receipt_handle)

    delete_message.serialised = True  # type: ignore[attr-defined]
    Queue.delete_message = delete_message  # type: ignore[method-assign]


def _untracked(cls: type, *args: Any, **kwargs: Any) -> Any:
    return object.__new__(cls)


def _forget_dynamodb_models() -> None:
    # ``__new__`` of moto's BaseModel appends each instance to ``instances_tracked``;
    # object's does not. moto's reset puts a fresh list back, so the list is not the hook.
    for model in model_data["dynamodb"].values():
        model.__new__ = staticmethod(_untracked)  # type: ignore[method-assign]


class _OneItemOf:
    """A table as moto's PartiQL sees it: one item (or none), no indexes; writes
    and everything else go to the table itself."""

    def __init__(self, table: Table, item: Any) -> None:
        self._table = table
        self._item = item

    def all_items(self) -> list[Any]:
        return [] if self._item is None else [self._item]

    def all_indexes(self) -> list[Any]:
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)


def _named_item(backend: DynamoDBBackend, statement: str, parameters: list[Any]) -> Any:
    """The view of an ``UPDATE``'s table holding just the item its ``WHERE`` names
    with ``?`` parameters on every key attribute; None for any other statement."""
    if not statement.lstrip()[:7].upper().startswith("UPDATE"):
        return None
    try:
        table_name, updates, filters = UpdateParser().parse(statement.replace("\n", " "))
    except Exception:
        return None  # moto's own path reports it
    table = backend.tables.get(table_name)
    set_by_parameter = sum(value == "?" for _, value in updates)
    if table is None or len(parameters) != set_by_parameter + sum(v == "?" for _, v in filters):
        return None
    values = iter(parameters[set_by_parameter:])
    named = {name: next(values) for name, value in filters if value == "?"}
    keys = [table.hash_key_attr] + ([table.range_key_attr] if table.range_key_attr else [])
    if not all(key in named for key in keys):
        return None
    hash_key = DynamoType(named[table.hash_key_attr])
    range_key = DynamoType(named[table.range_key_attr]) if table.range_key_attr else None
    return _OneItemOf(table, table.get_item(hash_key, range_key))


def _partiql_updates_on_their_item() -> None:
    everything = DynamoDBBackend.execute_statement

    @functools.wraps(everything)
    def execute_statement(
        self: DynamoDBBackend, statement: str, parameters: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        view = _named_item(self, statement, parameters)
        if view is None:
            return everything(self, statement, parameters)
        tables = self.tables
        # One DynamoDB request at a time (_serialise_dynamodb): nobody else sees the swap.
        self.tables = {view.name: view}
        try:
            return everything(self, statement, parameters)
        finally:
            self.tables = tables

    DynamoDBBackend.execute_statement = execute_statement  # type: ignore[method-assign]


class _ReadBodyOnce:
    """The connection's input for werkzeug once the body is read: lines (the next
    request line and headers) as usual, but ``read`` finds nothing. After each
    response werkzeug reads whatever is on the socket to discard an unread body,
    which on a kept connection would swallow the next request."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def read(self, size: int = -1) -> bytes:
        return b""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class KeepAliveHandler(MotoRequestHandler):
    """moto's handler, keeping the connection open after a request whose body it read whole."""

    _body_read = False
    # werkzeug writes the headers and the body apart: without this, Nagle holds the
    # body until the client's delayed ACK of the headers (40 ms) on a kept connection.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self._raw_input: Any = self.rfile
        self.rfile = _ReadBodyOnce(self.rfile)  # type: ignore[assignment]

    def make_environ(self) -> dict[str, Any]:
        self._body_read = False
        environ = super().make_environ()
        if environ.get("wsgi.input_terminated"):  # chunked: werkzeug reads it, then closes
            environ["wsgi.input"] = DechunkedInput(self._raw_input)
            return environ
        length = environ.get("CONTENT_LENGTH") or ""
        size = int(length) if length.isdigit() else 0
        environ["wsgi.input"] = io.BytesIO(self._raw_input.read(size) if size else b"")
        self._body_read = True
        return environ

    def send_header(self, keyword: str, value: str) -> None:
        # werkzeug sends "Connection: close" with every response; http.server then
        # closes. With the body read, the next request line is next on the socket.
        if self._body_read and keyword.lower() == "connection" and value.lower() == "close":
            return
        super().send_header(keyword, value)


def main(argv: list[str] | None = None) -> None:
    _serialise_dynamodb()
    serialise_sqs_deletes()
    _forget_dynamodb_models()
    _partiql_updates_on_their_item()
    gc.collect()
    gc.freeze()
    # moto's main() hands this name to werkzeug's run_simple
    setattr(moto.server, "MotoRequestHandler", KeepAliveHandler)  # noqa: B010
    moto.server.main(argv)


if __name__ == "__main__":
    main()
