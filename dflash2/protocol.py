"""The control protocol between dflash2d and its clients: one module both sides import.

Transport: ZeroMQ, a ROUTER socket in the daemon and a DEALER per client socket. Every message is a
list of frames whose first three never change between versions, so that a mismatched peer always
gets a clear error instead of a hang:

    [MAGIC, VERSION (ASCII decimal), HEADER (JSON object), *ARRAYS (raw little-endian numpy bytes)]

Request header: {"op": name, "id": call id, "client": id or null, "token": session token or null,
                 "args": {...}} (HEADER_FIELDS: any other field is refused, and so is a key named
                 twice in any object of it)
Reply header:   {"id": call id, "ok": true, "result": {...}}
           or   {"id": call id, "ok": false, "error": {"type": name, "message": text}}

Hot operations take and return whole batches; their arrays travel as binary frames (keys as
uint64, block ids as int64, places as PLACE_DTYPE records), never as JSON lists. New fields are only
ever appended; an op whose arguments change gets a new name.

Operations (args → result; [frames] are binary arrays; `places` = PLACE_DTYPE records; `ARGS` below
holds the arguments each op takes, and any other is refused; an argument shown `=null` may be
sent as an explicit null, which means its default):

    ping             {}                                        → {version, pid}
    attach           {name, pid, layouts: [layout dict], prefill_tokens_per_s=[rate or null per layout],
                      pid_namespace=null, gpu_uuid=null or device=null}
                                                               → {client, layouts: [id], arenas: [{tier,
                                                                  kind, name, capacity_bytes, alignment}],
                                                                  lease_timeout_s, heartbeat_interval_s, device,
                                                                  token, liveness: the name of the daemon's
                                                                  liveness object in /dev/shm, locked while it
                                                                  lives (arena/liveness.py); absent or null from
                                                                  an older daemon, which has none; set_aside_s:
                                                                  how long a lapsed client's slots are kept,
                                                                  absent from an older daemon, read as 0}
    heartbeat        {}                                        → {lease_timeout_s}
    detach           {}                                        → {released: {...}}
    register_layout  {layout: layout dict, prefill_tokens_per_s=null}
                                                               → {layout: id}
    prefill_rate     {layout, tokens_per_s (null: withdrawn)}  → {} (this client's engine recomputes the
                                                                  layout's blocks at this rate: lookups offer
                                                                  only blocks that load faster)
    reserve          {layout, tokens, priority=0, deadline_s=null (from now), request=0}
                                                               → decision {outcome, reservation_id, reason,
                                                                  position, est_wait_s}
    reservation      {reservation}                             → decision
    take             {reservation, n}                          → [places] (blocks to write)
    cancel           {reservation}                             → {}
    allocate         {layout, n, request=0, priority=0, tier="hbm"}
                                                               → {allocated: bool} [places]
    commit           {parent=null} [vids, keys or empty]       → [vids] (the ids now held: a key that was
                                                                  cached already deduplicates)
    lookup           {layout=null, tier="hbm", probe=false} [keys]
                                                               → {withheld} [places] of the longest cached
                                                                  prefix (tier "dram": a host reader, no
                                                                  prefetch) that loads faster than this
                                                                  client's engine recomputes it; withheld:
                                                                  cached blocks past it that do not; probe:
                                                                  a question about blocks, not a request's
                                                                  prefix (heat's duel does not replay it, the
                                                                  lookup figures do not count it)
    acquire          {tier="hbm", priority=null} [vids]        → {acquired: bool} [places] (pinned in that tier
                                                                  or a faster one; "dram": read where they are)
    release          {} [vids]                                 → {}
    add_ref          {priority=null} [vids]                    → {}
    free             {} [vids]                                 → {freed: n}
    places           {} [vids]                                 → [places]
    stats            {}                                        → tiers, hit rates, moves, clients, reservations
    set_weights      {weights: {name: value}}                  → {policy}
    check            {}                                        → {} (or the invariant violation as error)
    forget           {call} [vids: a commit's, optional]       → {undone: bool, expired: true (it ran and is
                                                                  too old to undo: past the client's last 64
                                                                  undoable calls, daemon/sessions.py)} (the
                                                                  client gave up waiting on its call `call`:
                                                                  undone if it ran, never run if it had not;
                                                                  see UNDOABLE)
    retry            {op: "release" | "free", call} [vids]      → {ran: bool, freed: n (a free's)} (the client's
                                                                  call `call` timed out: run it unless it ran;
                                                                  run, it is not run again; see RETRIED)
    history          {since_s=null (all kept)}                 → {interval_s, count, enabled} [samples as
                                                                  JSON lines] (dflash2/history.py)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
import re
import unicodedata

import numpy as np

from dflash2 import strictjson
from dflash2.errors import ProtocolError, VersionMismatch

MAGIC = b"DFLASH2"
# 2: attach names the client's GPU by UUID (`gpu_uuid`); a version-1 daemon would ignore it and hand
# every such client its first GPU's pool, so the two refuse each other with a clear error instead.
# 3: a session token (attach returns it; every call of an attached client carries it in the header:
# a client id, which `stats` lists, no longer lets another process act for that client) and `forget`.
VERSION = 3
MAX_BATCH = 65536  # most ids or keys in one call
MAX_HEADER_BYTES = 1 << 20  # of a request: the daemon's own replies (stats of many clients) may be larger
MAX_REPLY_HEADER_BYTES = 64 << 20
MAX_NAME_CHARS = 128  # a client's name at attach (it is listed in every `stats` reply)


# What a name may not hold: control characters, lone surrogates, line and paragraph separators
# (Unicode categories), and the bidirectional overrides and isolates, which reorder what a terminal
# shows after them. Spaces of every kind, joiners and letters of every script are fine (refused by
# str.isprintable, a model path with a full-width space turned dflash2 off for sglang, a review).
_NOT_IN_NAMES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_BIDI_CONTROLS = frozenset(chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A)))


def unprintable(text: str) -> str | None:
    """What makes `text` unfit to print as a name, or None: a client's name and a layout's are
    printed by `dflash2 status` and written into the log (a surrogate made `dflash2 status` fail for
    everyone while that client was attached, and a newline or an escape forged log lines and rewrote
    operators' terminals, a review)."""
    bad = next((ch for ch in text if unicodedata.category(ch) in _NOT_IN_NAMES or ch in _BIDI_CONTROLS), None)
    return None if bad is None else f"holds a control character or one that does not print ({bad!r})"


def printable(text: str) -> str:
    """`text` with each character `unprintable` refuses written as its escape (`\\n`, `\\x1b`,
    `\\u202e`): for text the daemon prints but did not choose, as another process's command line
    (argv[0] is anyone's to choose: a newline in it forged a "dflash2d: error:" line, a review)."""
    return "".join(ch.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(ch) in _NOT_IN_NAMES or ch in _BIDI_CONTROLS else ch for ch in text)


def client_name(name: str) -> str:
    """An attach's `name`, checked (ProtocolError naming what is wrong)."""
    if not name.strip() or all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in name):
        # (format characters alone, zero-width spaces, marks or a BOM, showed blank too: a review)
        raise ProtocolError("attach: argument 'name' is empty: name the client (it is how `dflash2 status` and "
                            "the log tell clients apart)")
    if len(name) > MAX_NAME_CHARS:
        raise ProtocolError(f"attach: argument 'name' has {len(name)} characters, more than {MAX_NAME_CHARS}")
    why = unprintable(name)
    if why is not None:
        raise ProtocolError(f"attach: argument 'name' {why}")
    return name
TOKEN_CHARS = 32  # a session token: 16 random bytes in hex
_HEX_RUN = re.compile("[0-9a-f]*")  # a token's characters: one match, not a Python step per character
# Largest frame the daemon accepts (ZMQ_MAXMSGSIZE on its socket; a peer that sends a larger one is
# disconnected without a reply). A valid request's frames are at most MAX_HEADER_BYTES (the header)
# or MAX_BATCH 8-byte ids or keys: the bound only stops a peer from making the daemon, and every
# client waiting on it, copy and parse a huge frame before the batch check could refuse it.
MAX_FRAME_BYTES = 4 << 20
# Array frames a request carries at most (commit's block ids and keys; every other op one or none).
# The frame bound above is per frame: a request with more frames is refused, and the daemon's
# receive does not copy those past the last it could use (zmqio.recv_frames `most`).
MAX_ARRAYS = 2
MAX_REQUEST_FRAMES = 3 + MAX_ARRAYS
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
VERSION_FRAME = str(VERSION).encode()
# One encoder for every header: json.dumps with separators builds a new one per call.
_encode_json = json.JSONEncoder(separators=(",", ":")).encode


def _plain_number(value):
    """A numpy number in a request's arguments (a prefill rate computed with numpy) as the Python
    number it is: the JSON encoder refused it (`Object of type float32 is not JSON serializable`).
    Other values still fail there, as a TypeError naming their type."""
    if isinstance(value, np.generic) and isinstance(value, numbers.Real) and not isinstance(value, np.bool_):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# Requests only: a reply with a numpy number in it is the daemon's bug, and fails loudly.
_encode_request_json = json.JSONEncoder(separators=(",", ":"), default=_plain_number).encode

KEYS_DTYPE = np.dtype("<u8")
VIDS_DTYPE = np.dtype("<i8")
# Where a block lies: enough to build a zero-copy view once the client has mapped the arenas.
PLACE_DTYPE = np.dtype([("vid", "<i8"), ("tier", "i1"), ("offset", "<i8"), ("nbytes", "<i8"),
                        ("layout", "<i4")])


class Op(str, enum.Enum):
    PING = "ping"
    ATTACH = "attach"
    HEARTBEAT = "heartbeat"
    DETACH = "detach"
    REGISTER_LAYOUT = "register_layout"
    RESERVE = "reserve"
    RESERVATION = "reservation"  # status of a reservation (deferred ones report position/wait)
    TAKE = "take"  # blocks of a granted reservation
    CANCEL = "cancel"
    ALLOCATE = "allocate"
    COMMIT = "commit"
    LOOKUP = "lookup"
    ACQUIRE = "acquire"
    RELEASE = "release"
    FREE = "free"
    ADD_REF = "add_ref"
    PLACES = "places"
    STATS = "stats"
    SET_WEIGHTS = "set_weights"
    CHECK = "check"  # run the table's invariant check (tests, operators)
    HISTORY = "history"  # the daemon's time series of key figures (history_enabled)
    PREFILL_RATE = "prefill_rate"  # the client's engine's prefill rate for a layout (cost-aware reuse)
    FORGET = "forget"  # the client timed out on one of its calls: undo it if it ran, skip it if not
    RETRY = "retry"  # the client timed out on a release or free: run it unless it ran


_OPS = {op.value: op for op in Op}  # (a dict lookup: Op(name) is an enum call, a Python function)

# Ops that need an attached client (the header's "client"); the rest do not.
NEEDS_CLIENT = frozenset(Op) - {Op.PING, Op.ATTACH, Op.STATS, Op.CHECK, Op.HISTORY}
# What a tcp client holding only the monitoring key (dflash2/tcpkeys.py) may call: the daemon answers
# it nothing else (AccessDenied), as it must not attach, take memory or publish blocks.
READ_ONLY = frozenset({Op.PING, Op.STATS, Op.CHECK, Op.HISTORY})
# Calls that give their client something it must give back (blocks, a reservation, pins,
# references). A client that timed out on one never learned what it got, so it sends `forget`
# and the daemon gives it back; the other calls leave nothing held that the client does not know of.
# A commit leaves the writer references on the blocks it returns, whose ids may not be the ones it
# named (a key already cached): forgotten, those references are dropped if it ran, and the blocks
# it named (still the writer's, being written) freed if it had not (the writer gave up on them): its
# `forget` names them too (an array frame, appended: an older daemon ignores it, and an older
# client's `forget` without it is taken as before), so that they are freed though the commit never
# arrives (lost with a socket that had not connected to a stopped daemon).
UNDOABLE = frozenset({Op.ALLOCATE, Op.TAKE, Op.RESERVE, Op.ACQUIRE, Op.ADD_REF, Op.COMMIT})
# Calls that give back what an UNDOABLE one handed out (pins, references). A client that timed out on
# one sends it again, as a `retry` naming its call id, on each new socket until answered: one lost
# with a socket that never connected to a stopped daemon left its pins held for the client's life. The
# daemon runs each call id once, whichever comes first (pins and references are counted per client: a
# second release would drop another thread's pin). A new op, so that an older daemon refuses it
# (unknown op) rather than running a release twice.
RETRIED = frozenset({Op.RELEASE, Op.FREE})
# The arguments each op reads (header.args); any other is refused, naming it (ProtocolError): a
# misspelt one ({"teir": "dram"}) ran the call with the default (a host writer's blocks taken in
# HBM), silently (a review). `request_port` goes with every call of a monitoring-key transport
# (client/transport.py), whichever op it is.
ARGS: dict[Op, frozenset[str]] = {op: frozenset(names) for op, names in {
    Op.PING: (), Op.HEARTBEAT: (), Op.DETACH: (), Op.STATS: (), Op.CHECK: (),
    Op.RELEASE: (), Op.FREE: (), Op.PLACES: (),
    Op.ATTACH: ("name", "pid", "layouts", "pid_namespace", "prefill_tokens_per_s", "gpu_uuid", "device"),
    Op.REGISTER_LAYOUT: ("layout", "prefill_tokens_per_s"),
    Op.PREFILL_RATE: ("layout", "tokens_per_s"),
    Op.RESERVE: ("layout", "tokens", "priority", "request", "deadline_s"),
    Op.RESERVATION: ("reservation",), Op.TAKE: ("reservation", "n"), Op.CANCEL: ("reservation",),
    Op.ALLOCATE: ("layout", "n", "request", "priority", "tier"),
    Op.COMMIT: ("parent",),
    Op.LOOKUP: ("layout", "tier", "probe"),
    Op.ACQUIRE: ("tier", "priority"),
    Op.ADD_REF: ("priority",),
    Op.SET_WEIGHTS: ("weights",),
    Op.HISTORY: ("since_s",),
    Op.FORGET: ("call",), Op.RETRY: ("op", "call"),
}.items()}
TRANSPORT_ARGS = frozenset({"request_port"})
# The array frames each op reads (Request.array), at most; a request with more is refused, naming
# them: a release of [a] and [b] as two frames released a, answered ok and left b pinned (a review).
ARRAYS: dict[Op, int] = {op: 0 for op in Op} | {
    Op.COMMIT: 2,  # block ids, content keys
    Op.LOOKUP: 1,  # content keys
    Op.ACQUIRE: 1, Op.RELEASE: 1, Op.FREE: 1, Op.ADD_REF: 1, Op.PLACES: 1, Op.RETRY: 1,  # block ids
    Op.FORGET: 1,  # block ids of a commit given up on
}


@dataclasses.dataclass
class Request:
    op: Op
    call_id: int
    client: int | None
    args: dict
    arrays: list[bytes]
    token: str | None = None

    def array(self, index: int, dtype: np.dtype, name: str) -> np.ndarray:
        """The index-th binary frame as an array; ProtocolError names the missing or bad argument."""
        if index >= len(self.arrays):
            raise ProtocolError(f"{self.op.value}: missing array frame {index} ({name})")
        raw = self.arrays[index]
        if len(raw) % dtype.itemsize:
            raise ProtocolError(f"{self.op.value}: {name} frame is {len(raw)} bytes, not a whole number "
                                f"of {dtype.itemsize}-byte items")
        arr = np.frombuffer(raw, dtype=dtype)
        if len(arr) > MAX_BATCH:
            raise ProtocolError(f"{self.op.value}: {len(arr)} {name} in one call, more than {MAX_BATCH}")
        return arr


@dataclasses.dataclass
class Reply:
    call_id: int
    ok: bool
    result: dict
    error_type: str = ""
    error_message: str = ""
    arrays: list[bytes] = dataclasses.field(default_factory=list)


# A request header's fields; any other is refused, naming them: a misspelt one ("arg" for "args") ran
# the call with its defaults, silently, as a misspelt argument did (ARGS; a review). A field added
# later comes with a new VERSION, which an older daemon refuses by name.
HEADER_FIELDS = frozenset({"op", "id", "client", "token", "args"})


def _frames_head(frames: list[bytes], max_header: int = MAX_HEADER_BYTES, strict: bool = False) -> dict:
    if len(frames) < 3:
        raise ProtocolError(f"a message needs at least 3 frames (magic, version, header), got {len(frames)}")
    if bytes(frames[0]) != MAGIC:
        raise ProtocolError("not a dflash2 message (bad magic frame)")
    if bytes(frames[1]) != VERSION_FRAME:  # (the frame every peer of this version sends: no parse)
        try:
            version = int(bytes(frames[1]).decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise ProtocolError("the version frame is not a decimal number") from None
        if version != VERSION:
            raise VersionMismatch(f"protocol version mismatch: this side speaks {VERSION}, the peer {version}; "
                                  "upgrade the older of daemon and client")
    if len(frames[2]) > max_header:
        raise ProtocolError(f"header of {len(frames[2])} bytes exceeds {max_header}")
    raw = bytes(frames[2])
    # A request's header names each key once (`strict`, strictjson): json keeps the last of two, so
    # `{"op": "free", ..., "op": "ping"}` ran a ping, and `"tier": "dram", "tier": "hbm"` took HBM,
    # silently (a review); the tcp gate (daemon/keygate.py) reads it with this parse too, so the op it
    # lets through is the one the loop runs. A reply is the daemon's encoder's, which cannot name a key
    # twice, and may be large (stats): read as before.
    decode, loads = (strictjson.decode, strictjson.loads) if strict else (json.loads, json.loads)
    try:
        try:
            header = decode(raw.decode("utf-8"))  # (json.loads of bytes first guesses their encoding)
        except ValueError:
            header = loads(raw)  # as before: a BOM, UTF-16 or UTF-32, or the error that names what is wrong
    except strictjson.KeyTwice as e:
        raise ProtocolError(f"header.{e.path} is named twice: send each key once (JSON keeps the last, which "
                            "may not be the one meant)") from None
    except ValueError as e:
        if "integer string conversion" in str(e):  # (its advice, sys.set_int_max_str_digits, is the daemon's, a review)
            raise ProtocolError("header holds an integer of more than 4300 digits: no argument takes one") from None
        raise ProtocolError(f"header is not valid JSON: {e}") from None
    except RecursionError:  # a few kilobytes of "[[[[..." exhaust the parser's stack
        raise ProtocolError("header is not valid JSON: nested too deeply") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    return header


# The start of a header as `encode_request` writes it: `{"op":"...","id":N,`. Read from the first
# bytes of a header too large to parse, so that its refusal reaches the call that made it (with id 0
# the caller's library dropped the reply as not its own and waited out its timeout, a review).
_HEADER_START = re.compile(rb'\{\s*"op"\s*:\s*"[a-z_]{1,40}"\s*,\s*"id"\s*:\s*(\d{1,19})\s*[,}]')


def peek_call_id(frames: list[bytes]) -> int:
    """Best-effort call id of a message that failed to decode (0 when unknown), for the error reply."""
    try:
        found = _HEADER_START.match(bytes(memoryview(frames[2])[:200]))
        if len(frames[2]) > MAX_HEADER_BYTES:
            return int(found.group(1)) if found else 0
        try:
            header = json.loads(bytes(frames[2]))
        except ValueError:  # (malformed past its start: a number of 5,000 digits was answered as call 0, a review)
            return int(found.group(1)) if found else 0
        cid = header.get("id", 0)
        return cid if type(cid) is int else 0  # (`"id": true` was answered as call `true`, no integer: a review)
    except Exception:
        return 0


def encode_request(op: Op, call_id: int, client: int | None, args: dict | None = None,
                   arrays: list[bytes] | None = None, version: int = VERSION, token: str | None = None) -> list[bytes]:
    header = {"op": op.value, "id": call_id, "client": client, "token": token, "args": args or {}}
    frames = [MAGIC, VERSION_FRAME if version == VERSION else str(version).encode(),
              _encode_request_json(header).encode(),
              *(arrays or [])]
    if len(frames[2]) > MAX_HEADER_BYTES:  # (refused by the daemon: said here, before it is sent)
        raise ProtocolError(f"{op.value}: a header of {len(frames[2])} bytes is more than the daemon accepts "
                            f"({MAX_HEADER_BYTES}; an argument too long?)")
    check_frames(op, frames)
    return frames


def check_frames(op: Op, frames) -> None:
    """ProtocolError when a frame is more than the daemon accepts (it would disconnect the sender)."""
    big = max((memoryview(f).nbytes for f in frames or ()), default=0)
    if big > MAX_FRAME_BYTES:
        raise ProtocolError(f"{op.value}: a frame of {big} bytes is more than the daemon accepts ({MAX_FRAME_BYTES}; "
                            f"a call carries at most {MAX_BATCH} ids or keys)")


def decode_request(frames: list[bytes], *, check_args: bool = True) -> Request:
    """The request of these frames (ProtocolError naming what is wrong). `check_args=False`: its
    arguments' names unchecked (the tcp endpoint's key gate, which refuses a call by its op first)."""
    if len(frames) > MAX_REQUEST_FRAMES:
        raise ProtocolError(f"a request has at most {MAX_REQUEST_FRAMES} frames (magic, version, header and "
                            f"up to {MAX_ARRAYS} arrays), got more")
    header = _frames_head(frames, strict=True)
    if not header.keys() <= HEADER_FIELDS:
        unknown = ", ".join(map(repr, sorted(map(str, header.keys() - HEADER_FIELDS))))
        raise ProtocolError(f"unknown header field(s) {unknown} (a request's header has: "
                            f"{', '.join(sorted(HEADER_FIELDS))})")
    name = header.get("op")
    op = _OPS.get(name) if isinstance(name, str) else None
    if op is None:
        raise ProtocolError(f"unknown op {name!r}; valid: {', '.join(o.value for o in Op)}")
    needs_client = op in NEEDS_CLIENT
    call_id, client, args = header.get("id"), header.get("client"), header.get("args", {})
    token = header.get("token")
    if not isinstance(call_id, int) or isinstance(call_id, bool) or not 1 <= call_id <= INT64_MAX:
        # (0 is the id of the daemon's answer to a message it cannot read, and `forget` names a call
        # by an id in this range: a call run under id 0 or 2**64 could not be forgotten, a review)
        raise ProtocolError(f"header.id must be an integer call id in [1, {INT64_MAX}], got {call_id!r}")
    if client is not None and (not isinstance(client, int) or isinstance(client, bool)):
        raise ProtocolError("header.client must be an integer or null")
    if needs_client and client is None:
        raise ProtocolError(f"{op.value} needs an attached client (header.client)")
    if token is not None and (not isinstance(token, str) or len(token) > TOKEN_CHARS
                              or not _HEX_RUN.fullmatch(token)):
        raise ProtocolError(f"header.token must be the session token attach returned ({TOKEN_CHARS} hex characters)")
    if needs_client and token is None:
        raise ProtocolError(f"{op.value} needs the session token attach returned (header.token)")
    if not isinstance(args, dict):
        raise ProtocolError("header.args must be a JSON object")
    unknown = args.keys() - ARGS[op] - TRANSPORT_ARGS if check_args else ()
    if unknown:
        takes = ", ".join(sorted(ARGS[op])) or "none"
        raise ProtocolError(f"{op.value}: unknown argument(s) {', '.join(map(repr, sorted(map(str, unknown))))} "
                            f"(it takes: {takes})")
    # The transport's argument is checked as the monitoring socket's gate checks it (keygate.py): on
    # the request socket, which ignores it, `"request_port": "junk"` ran the call, silently (a review).
    port = args.get("request_port")
    if check_args and "request_port" in args and (type(port) is not int or not 1 <= port <= 65535):
        raise ProtocolError(f"{op.value}: argument 'request_port' must be the tcp port (1-65535) of the daemon the "
                            f"call asks about, got {port!r}")
    if check_args and len(frames) - 3 > ARRAYS[op]:
        raise ProtocolError(f"{op.value} reads {ARRAYS[op]} array frame{'' if ARRAYS[op] == 1 else 's'} "
                            f"at most, got {len(frames) - 3}")
    return Request(op, call_id, client, args, [bytes(f) for f in frames[3:]], token)


def encode_reply(reply: Reply) -> list[bytes]:
    if reply.ok:
        header = {"id": reply.call_id, "ok": True, "result": reply.result}
    else:
        header = {"id": reply.call_id, "ok": False,
                  "error": {"type": reply.error_type, "message": reply.error_message}}
    return [MAGIC, VERSION_FRAME, _encode_json(header).encode(), *reply.arrays]


def decode_reply(frames: list[bytes]) -> Reply:
    header = _frames_head(frames, MAX_REPLY_HEADER_BYTES)
    call_id = header.get("id")
    ok = header.get("ok")
    if ok is True:
        return Reply(call_id, True, header.get("result") or {}, arrays=[bytes(f) for f in frames[3:]])
    err = header.get("error")
    # A reply says ok, or names its error: anything else is not dflash2d's answer (a program that
    # echoes frames back answered as an error with no message: `dflash2 status: Error: `).
    if ok is not False or not isinstance(err, dict) or not isinstance(err.get("type"), str):
        raise ProtocolError("not a dflash2d reply (its header has neither \"ok\": true nor an error): "
                            "is another program listening on the endpoint?")
    return Reply(call_id, False, {}, err["type"], str(err.get("message", "")))


def error_reply(call_id: int, exc: BaseException) -> Reply:
    return Reply(call_id, False, {}, type(exc).__name__, str(exc))


def arg(req: Request, name: str, kind: type | tuple, *, default=..., lo=None, hi=None):
    """A typed argument; ProtocolError names the op, the argument and what is wrong. An argument
    whose default is None takes an explicit null as that default: the op table writes those
    defaults as `=null`, and a client in another language that spelled the default out was
    refused "must be int, got NoneType" (a review)."""
    if name not in req.args or default is None and req.args[name] is None:
        if default is ...:
            raise ProtocolError(f"{req.op.value}: missing argument {name!r}")
        return default
    value = req.args[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ProtocolError(f"{req.op.value}: argument {name!r} must be {names}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{req.op.value}: argument {name!r} must be a finite number, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # Every number the daemon stores is at most 64-bit: a larger one is refused here, before
        # any state changes, whatever bounds the caller gave.
        lo = INT64_MIN if lo is None else max(lo, INT64_MIN)
        hi = INT64_MAX if hi is None else min(hi, INT64_MAX)
        if value < lo or value > hi:
            raise ProtocolError(f"{req.op.value}: argument {name!r}={value!r} is outside [{lo}, {hi}]")
    return value
