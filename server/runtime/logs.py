"""Log output: plain lines for people, or one JSON object per line for a collector.

JSON records carry the node id, and the connection id when the record was
written while serving one connection (the handler sets :data:`connection_id`
for its task) or names one explicitly (``extra={"connection_id": ...}``).
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

connection_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "connection_id", default=None
)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "node": self.node_id,
        }
        connection = getattr(record, "connection_id", None) or connection_id.get()
        if connection is not None:
            entry["connection"] = connection
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, log_format: str, node_id: str) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(node_id))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # One line per socket open and close costs real CPU in a connect storm.
    logging.getLogger("websockets").setLevel(max(logging.WARNING, root.level))
