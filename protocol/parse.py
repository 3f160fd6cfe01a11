"""Parse and validate untrusted input into typed messages.

Every function here either returns a typed value or raises
:class:`~protocol.errors.ProtocolError` with a message fit for the client.
Unknown extra fields are ignored, as the live client sends them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard, TypeVar

import msgpack

from protocol.chat import parse_chat
from protocol.errors import (
    GAME_KEY_SEPARATOR,
    MAX_ACK_ID_CHARS,
    MAX_GAME_FIELD_CHARS,
    MAX_TOKEN_CHARS,
    MAX_WATCHED_GAMES,
    ErrorCode,
    ProtocolError,
)
from protocol.messages import (
    GAME_VERBS,
    USER_VERBS,
    AdminTest,
    BotOutbound,
    Broadcast,
    ClientAction,
    GameEvent,
    GameKey,
    Position,
    Since,
    Subscribe,
    SyncPresence,
    UserEvent,
    WatchGames,
    game_key,
)
from protocol.streams import MAX_SINCE_STREAMS, MAX_USERS_PER_PUBLISH


def decode_frame(data: str | bytes) -> Any:
    """Decode one frame: text frames are JSON, binary frames are msgpack."""
    try:
        if isinstance(data, str):
            return json.loads(data)
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except RecursionError:
        raise ProtocolError(ErrorCode.INVALID_FRAME, "frame is nested too deeply") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        kind = "JSON" if isinstance(data, str) else "msgpack"
        raise ProtocolError(ErrorCode.INVALID_FRAME, f"frame is not valid {kind}") from exc


def parse_client_frame(data: str | bytes) -> ClientAction:
    """Parse one client frame into a typed action."""
    return parse_client_message(decode_frame(data))


def parse_client_message(message: Any) -> ClientAction:
    """Validate a decoded client message and build its action."""
    if not isinstance(message, Mapping):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "message must be an object")
    action = message.get("action")
    if action == "subscribe":
        return _acked(message, _parse_subscribe)
    if action == "watchGames":
        return _acked(message, _parse_watch_games)
    if action == "syncPresence":
        return SyncPresence()
    if action == "chat":
        return parse_chat(message)
    if not isinstance(action, str):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "message needs a string 'action'")
    raise ProtocolError(ErrorCode.UNKNOWN_ACTION, f"unknown action {_quote(action)}")


A = TypeVar("A", Subscribe, WatchGames)


def _acked(message: Mapping[str, Any], parse: Callable[[Mapping[str, Any], str | None], A]) -> A:
    """Parse an action that may carry an ``ackId``; its errors then carry it too."""
    ack_id = _parse_ack_id(message)
    try:
        return parse(message, ack_id)
    except ProtocolError as exc:
        exc.ack_id = ack_id
        raise


def _parse_ack_id(message: Mapping[str, Any]) -> str | None:
    value = message.get("ackId")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ACK_ID_CHARS or not _is_utf8(value):
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"'ackId' must be a string of 1 to {MAX_ACK_ID_CHARS} characters",
        )
    return value


def _parse_watch_games(message: Mapping[str, Any], ack_id: str | None) -> WatchGames:
    return WatchGames(
        games=_parse_games(message.get("games"), required=True) or frozenset(),
        since=parse_since(message.get("since")),
        ack_id=ack_id,
    )


def _parse_subscribe(message: Mapping[str, Any], ack_id: str | None) -> Subscribe:
    token = message.get("token")
    if not isinstance(token, str) or not token:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "subscribe needs a 'token'")
    if len(token) > MAX_TOKEN_CHARS:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "token is too long")
    watch_version = message.get("watchVersion")
    if watch_version is not None and (
        isinstance(watch_version, bool)
        or not isinstance(watch_version, int)
        or not 0 <= watch_version <= MAX_WATCH_VERSION
    ):
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"'watchVersion' must be a whole number from 0 to {MAX_WATCH_VERSION}",
        )
    return Subscribe(
        token=token,
        invisible=_parse_bool(message, "invisible", default=False),
        wants_presence=_parse_optional_bool(message, "wantsPresence"),
        watch_version=watch_version,
        games=_parse_games(message.get("games"), required=False),
        since=parse_since(message.get("since")),
        ack_id=ack_id,
        heartbeat=_parse_bool(message, "heartbeat", default=False),
    )


MAX_WATCH_VERSION = 1000
MAX_STREAM_NAME_CHARS = 300
MAX_EPOCH_CHARS = 64
MAX_OFFSET = 2**53  # a JSON number every client can hold exactly


def parse_since(value: Any) -> Since | None:
    """``{"<stream>": {"epoch": str, "offset": int >= 0}, ...}``; any flaw fails it all."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'since' must be an object")
    if len(value) > MAX_SINCE_STREAMS:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"'since' may name at most {MAX_SINCE_STREAMS} streams"
        )
    since: Since = {}
    for stream, position in value.items():
        if not isinstance(stream, str) or not 0 < len(stream) <= MAX_STREAM_NAME_CHARS:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'since' keys must be stream names")
        if not isinstance(position, Mapping):
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE, f"'since' of {_quote(stream)} must be an object"
            )
        epoch, offset = position.get("epoch"), position.get("offset")
        if not isinstance(epoch, str) or len(epoch) > MAX_EPOCH_CHARS:
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE, f"'epoch' of {_quote(stream)} must be a string"
            )
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= MAX_OFFSET:
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"'offset' of {_quote(stream)} must be a whole number from 0",
            )
        since[stream] = Position(epoch=epoch, offset=offset)
    return since


def _parse_bool(message: Mapping[str, Any], name: str, *, default: bool) -> bool:
    value = _parse_optional_bool(message, name)
    return default if value is None else value


def _parse_optional_bool(message: Mapping[str, Any], name: str) -> bool | None:
    value = message.get(name)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"'{name}' must be true or false")
    return value


def _parse_games(value: Any, *, required: bool) -> frozenset[GameKey] | None:
    """Parse a list of ``{meta, id}`` refs; entries missing either are ignored."""
    if value is None:
        if required:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'games' must be a list")
        return None
    if not isinstance(value, list):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'games' must be a list")
    keys: set[GameKey] = set()
    for entry in value:
        if not isinstance(entry, Mapping):
            continue
        meta, game_id = entry.get("meta"), entry.get("id")
        if not _is_game_field(meta) or not _is_game_field(game_id):
            continue
        _check_meta(meta)
        keys.add(game_key(meta, game_id))
        if len(keys) > MAX_WATCHED_GAMES:
            raise ProtocolError(
                ErrorCode.TOO_MANY_GAMES,
                f"at most {MAX_WATCHED_GAMES} games can be watched at once",
            )
    return frozenset(keys)


def _check_meta(meta: str) -> None:
    # ("a#b", "c") and ("a", "b#c") would share the key "a#b#c" and each
    # other's events; no game's meta holds the separator.
    if GAME_KEY_SEPARATOR in meta:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"a game's 'meta' may not contain {GAME_KEY_SEPARATOR!r}"
        )


def _is_game_field(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= MAX_GAME_FIELD_CHARS and _is_utf8(value)


def _is_utf8(value: str) -> bool:
    # json.loads lets lone surrogates through; they cannot be stored or re-encoded.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _quote(value: str) -> str:
    shown = value if len(value) <= 40 else value[:40] + "..."
    return json.dumps(shown)


def parse_broadcast(body: bytes | str) -> Broadcast:
    """Parse a backend broadcast, today's ``{"verb","payload","exclude"}``."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        raise ProtocolError(ErrorCode.INVALID_FRAME, "body is not valid JSON") from None
    if not isinstance(message, Mapping):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "body must be an object")
    verb = message.get("verb")
    payload = message.get("payload")
    exclude = _parse_exclude(message.get("exclude"))
    users = message.get("users")
    if users is not None:
        return Broadcast(event=_parse_user_event(verb, payload, users), exclude=exclude)
    if verb == "test":
        _check_encodable(payload)
        return Broadcast(event=AdminTest(payload=payload), exclude=exclude)
    if verb in GAME_VERBS:
        if not isinstance(payload, Mapping):
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"'{verb}' needs an object payload")
        meta, game_id = payload.get("meta"), payload.get("id")
        if not _is_game_field(meta) or not _is_game_field(game_id):
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE, f"'{verb}' payload needs string 'meta' and 'id'"
            )
        _check_meta(meta)
        _check_encodable(payload)
        event = GameEvent(
            verb="game" if verb == "game" else "chat",
            meta=meta,
            game_id=game_id,
            payload=dict(payload),
        )
        return Broadcast(event=event, exclude=exclude)
    if not isinstance(verb, str):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "body needs a string 'verb'")
    raise ProtocolError(ErrorCode.UNKNOWN_ACTION, f"unknown verb {_quote(verb)}")


def parse_bot_outbound(body: bytes | str) -> BotOutbound:
    """Parse a body of today's bot outbound queue; ProtocolError names what is wrong
    (not a JSON object, an unknown ``type``, a missing or empty field it needs)."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        raise ProtocolError(ErrorCode.INVALID_FRAME, "body is not valid JSON") from None
    if not isinstance(message, Mapping):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "body must be an object")
    kind = message.get("type")
    if kind == "move":
        needed = ("botId", "metaGame", "gameid")
    elif kind == "challenge":
        needed = ("botId", "metaGame", "challengeId")
    else:
        shown = _quote(kind) if isinstance(kind, str) else repr(kind)[:40]
        raise ProtocolError(ErrorCode.UNKNOWN_ACTION, f"unknown bot message type {shown}")
    for name in needed:
        if not _is_game_field(message.get(name)):
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"{kind!r} needs a string {name!r}")
    if not _is_user_id(message["botId"]):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'botId' is not a user id")
    _check_meta(message["metaGame"])
    if kind == "move":
        return BotOutbound("move", message["botId"], message["metaGame"], game_id=message["gameid"])
    return BotOutbound(
        "challenge",
        message["botId"],
        message["metaGame"],
        challenge_id=message["challengeId"],
        standing=message.get("standing") is True,
    )


def _parse_user_event(verb: Any, payload: Any, users: Any) -> UserEvent:
    if not isinstance(verb, str) or verb not in USER_VERBS:
        shown = _quote(verb) if isinstance(verb, str) else "a non-string verb"
        raise ProtocolError(
            ErrorCode.UNKNOWN_ACTION,
            f"{shown} cannot go to users; allowed: {', '.join(sorted(USER_VERBS))}",
        )
    if not isinstance(users, list) or not all(_is_user_id(user) for user in users):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'users' must be a list of user ids")
    unique = tuple(dict.fromkeys(users))
    if not unique:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'users' must name at least one user")
    if len(unique) > MAX_USERS_PER_PUBLISH:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"at most {MAX_USERS_PER_PUBLISH} users per publish, not {len(unique)}",
        )
    _check_encodable(payload)
    return UserEvent(verb=verb, users=unique, payload=payload)


def _is_user_id(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= MAX_GAME_FIELD_CHARS * 2 and _is_utf8(value)


def _check_encodable(payload: Any) -> None:
    # Refuse here what could not be sent to a msgpack client (lone surrogates,
    # integers over 64 bits) rather than fail on every recipient later.
    try:
        msgpack.packb(payload, use_bin_type=True)
    except (ValueError, TypeError, OverflowError):
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, "payload holds values that cannot be encoded"
        ) from None


def _parse_exclude(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(user, str) for user in value):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "'exclude' must be a list of user ids")
    return frozenset(value)
