"""Ember wire protocol, version 1: message kinds and their field layout.

Handshake frames are MessagePack maps (self-describing, rarely sent). After the
handshake every client frame is a *batch*: a MessagePack array of messages,
each message a short array whose first item is its kind. Every server frame is
an array of *responses* ``[req, status, payload]``. Arrays, not maps, keep the
hot path small: a pipelined op costs a few dozen bytes.

Client → server messages (positions after the kind)::

    OP      name, args, smask, outs, kwargs    args: tensor ids, except the
                                               positions set in bit-mask smask,
                                               which are literal scalars
    UPLOAD  id, dtype, shape, offset, data, total   (chunks share id; ready at total)
    DROP    ids
    READ    req, id
    SYNC    req
    CUSTOM  name, inputs, outs, scalars, out_specs   out_specs: [[shape, dtype], ...]
    CLOSE
    PING    req                                 answered by the network loop
    SHAPE   req, id                             shape of a data-dependent output
    GRAPH   graph_id, body                      register a recurring op group
    REPLAY  graph_id, bindings                  run a registered group
    EXPOSE  req, id, target_peer, downloads, ttl    (tensor movement)
    FETCH   id, source, capability, dtype, shape
    MOVE    id, dst_device, dst_session, dst_id     same-peer move

Server → client responses: ``[req, status, payload]`` with status OK,
ERROR (payload ``{kind, message, op}``) or CHUNK (part of a large read:
``[offset, data, total]``; the final OK carries ``[dtype, shape, offset, data,
total]``). ``req == 0`` with ERROR is a session-level error (the session ends).
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
ALPN = b"ember/1"

# client -> server message kinds
OP, UPLOAD, DROP, READ, SYNC, CUSTOM, CLOSE, PING, SHAPE, GRAPH, REPLAY, EXPOSE, FETCH, MOVE = range(14)
KIND_NAMES = ("Op", "Upload", "Drop", "Read", "Sync", "Custom", "Close", "Ping", "Shape",
              "Graph", "Replay", "Expose", "Fetch", "Move")

# response status
OK, ERROR, CHUNK = 0, 1, 2

# handshake reject codes
REJECT_VERSION = "version"
REJECT_DEVICE = "device"
REJECT_UNAUTHORIZED = "unauthorized"
REJECT_FULL = "full"
REJECT_PROTOCOL = "protocol"

DEFAULT_MAX_FRAME = 64 * 1024 * 1024
DEFAULT_CHUNK = 16 * 1024 * 1024

# Slice / None / Ellipsis inside an index key (see encode_key in codec).
KEY_SLICE, KEY_NONE, KEY_ELLIPSIS, KEY_ARRAY = "s", "n", "e", "a"
