"""Ember wire protocol, version 1: message kinds and their field layout.

The full specification (framing per transport, handshake, every kind's fields and
MessagePack types, limits, what a server must refuse) is ``docs/protocol.md``;
this docstring is its summary.

Handshake frames are MessagePack maps (self-describing, rarely sent). A Hello may
carry ``admin: true``: it then asks for an *admin session* (``ember top``,
``ember status``), judged by the peer's admin check (its ``credential`` must be
the peer's admin token, or the client's authenticated iroh peer id must be
allowlisted) instead of its authorizer; a refusal is a Reject ``unauthorized``
with the reason. An admin session is an ordinary session otherwise. After the
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
    GRAPH   gid, n_in, scalars, body, kept, consumed[, moving]    register a recurring op group
    REPLAY  gid, inputs, outs, scalar_overrides[, offsets]        run a registered group
    EXPOSE  id, capability, target_peer, downloads, ttl    (tensor movement)
    FETCH   id, source, capability, timeout     source None: take a MOVE token
    MOVE    id, token                           same-peer move
    ATEN    (reserved: ember.torch's ATen op stream)
    STATS   req, scope                          figures, answered with a map (ember.server.telemetry.figures):
                                                scope "session" (this session and its device;
                                                anyone) or "server" (every session, device, total
                                                and recent event: admin sessions only, others get
                                                an AuthorizationError). Sent alone in a batch, the
                                                network loop answers it at once, even while the
                                                worker is busy; inside a batch, in order.

Server → client responses: ``[req, status, payload]`` with status OK,
ERROR (payload ``{kind, message, op}``) or CHUNK (part of a large read:
``[offset, data, total]``; the final OK carries ``[dtype, shape, offset, data,
total]``). ``req == 0`` with ERROR is a session-level error (the session ends);
``[0, OK, None]`` is a keepalive (the peer is busy but alive; clients ignore it).
``[0, NEED_GRAPH, gid]``: a REPLAY named a graph this session's cache does not
hold; the server holds that REPLAY and everything after it until a GRAPH with
that gid arrives (see ``ember.client.graph`` for the graph protocol).

Data frames (feature ``"data"``; docs/protocol.md, "Data frames"). A frame whose first byte is ``DATA_MARK`` (0xC1, a byte
MessagePack never uses) is a *data frame*: ``0xC1, u32 big-endian n, n bytes of MessagePack
head, payload``. The head is an ordinary message or response whose bytes field is nil; the
payload, the rest of the frame, is that field's value, raw. Senders hand a view of the
array to the transport behind a small prefix (no copy into a MessagePack ``bin``);
receivers whose transport supports a data sink read the payload straight into the
destination array. Heads used::

    client -> server   [UPLOAD, id, dtype, shape, offset, nil, total]   one chunk of an upload
    server -> client   [req, CHUNK, [offset, nil, total]]               one chunk of a read
                       [req, OK, [dtype, shape, offset, nil, total]]    its last chunk
    transfer stream    [offset, nil, total]                             one chunk of a download

A data frame carries exactly one message and is a batch of its own. Both sides use data
frames only once they agreed on them: Hello carries ``features`` (the optional features the
client speaks), Welcome answers with ``features``, those both speak; a transfer request
carries ``features`` and the source answers in kind. A peer that knows no features sends and
expects only MessagePack frames, so old and new peers still talk (protocol version 1 either
way). Small tensors (at most ``INLINE_DATA`` bytes) keep riding inside batches.

Lanes (feature ``"lanes"``, with ``"data"``; docs/protocol.md, "Lanes"; ``protocol.lanes``). The
Welcome carries ``lanes: {key, max, min_bytes, chunk}``; the client may open up to ``max`` more streams
to the peer, each starting with ``{type: "lane", session_id, key}`` (answered ``{type: "lane"}``
or ``{type: "denied", reason}``), and stripe uploads and read answers of at least ``min_bytes``
over them as data frames (chunk-aligned, each chunk once). The session stream keeps the order::

    client -> server   [UPLOAD, id, dtype, shape, 0, nil, total]        in a batch: the bytes come
                                                                        on lanes; run once all arrived
    lanes              [UPLOAD, id, dtype, shape, offset, nil, total]   its chunks, any lane
    lanes              [req, CHUNK, [offset, nil, total]]               a striped read's chunks
    server -> client   [req, OK, [dtype, shape, total, nil, total]]     its end, no payload: complete
                                                                        once all total bytes arrived

A download between peers asks for ``lanes`` in its request; the source answers ``lanes``,
``lane_key`` and ``chunk``, and stripe ``i`` of ``protocol.lanes.stripe_bounds`` arrives on extra
transfer stream ``i`` (opened with ``{type: "transfer_lane", key, index}``; stripe 0 on the first).

Graphs (op-graph caching). A GRAPH body is a register program: registers
``0..n_in-1`` are the REPLAY's input tensors, the next ``len(scalars)`` are
scalars (defaults from the GRAPH, overridden per REPLAY by the flat list
``[index, value, ...]``), then one register per op output in order. ``body``
is ``[[name, arg_registers, n_outs, kwargs], ...]``; ``kept`` lists the output
registers bound, in order, to the REPLAY's ``outs`` ids (the others are
temporaries that never get an id); ``outs`` may instead be one int ``first``:
output register ``r`` then gets id ``first + r - n_in - len(scalars)`` (the
client allocated the step's ids in order). ``consumed`` lists input positions
dropped after the replay. ``gid`` is a 63-bit hash of the body without scalar values.
With feature ``"offsets"``, ``moving`` (flat ``[step, operand, ...]``) names input operands'
layouts whose offset each REPLAY may set (flat ``offsets`` ``[index, offset, ...]``): a loop
that slices a tensor on the peer at a moving position (``data[i:i+n]``) replays one graph.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
ALPN = b"ember/1"

# client -> server message kinds
OP, UPLOAD, DROP, READ, SYNC, CUSTOM, CLOSE, PING, SHAPE, GRAPH, REPLAY, EXPOSE, FETCH, MOVE, ATEN, STATS = range(16)
KIND_NAMES = ("Op", "Upload", "Drop", "Read", "Sync", "Custom", "Close", "Ping", "Shape",
              "Graph", "Replay", "Expose", "Fetch", "Move", "Aten", "Stats")

# response status
OK, ERROR, CHUNK, NEED_GRAPH = 0, 1, 2, 3

# handshake reject codes
REJECT_VERSION = "version"
REJECT_DEVICE = "device"
REJECT_UNAUTHORIZED = "unauthorized"
REJECT_FULL = "full"
REJECT_PROTOCOL = "protocol"
REJECT_LIMIT = "limit"      # a per-client limit (sessions per client identity)

DEFAULT_MAX_FRAME = 64 * 1024 * 1024
DEFAULT_CHUNK = 1024 * 1024
"""Bytes per chunk of a large upload or read. Small enough that both ends work on chunk k while
chunk k+1 is on the wire (16 MiB chunks measured 2-3x slower over WebSocket: see ember bench)."""
DEFAULT_GRAPH_CACHE = 256
"""Graphs a session's cache holds (LRU) unless the server says otherwise."""
MAX_GRAPH_OPS = 65536
"""Ops in one registered graph, at most (checked by the server)."""

#: First byte of a data frame (see above).
DATA_MARK = 0xC1
#: Bytes before a data frame's head: the mark and the head's length.
DATA_PREFIX = 5
#: Largest head a data frame may carry.
MAX_DATA_HEAD = 4096
#: Tensors up to this many bytes travel inside a batch (MessagePack ``bin``), larger ones in data frames.
INLINE_DATA = 64 * 1024
#: Optional wire features this version speaks, negotiated in Hello / Welcome.
FEATURES = ("data", "lanes", "compile", "offsets", "rnn_layers", "sparse_mm", "rng_state", "sparse_add")
DATA_FEATURE = "data"
#: Compiled graphs on the peer (``ember serve --compile``; server/execute/compiled.py): offered only by a
#: client that asks for them (``connect(..., compile=True)``), agreed only by a peer started with the option.
COMPILE_FEATURE = "compile"
#: GRAPH's ``moving`` and REPLAY's ``offsets``: input views whose offset changes from replay to replay.
OFFSETS_FEATURE = "offsets"
#: The internal ops ``torch.rnn_layer`` and ``torch.rnn_layer_backward`` (``server/execute/rnn_recompute.py``): an
#: ``nn.GRU`` / ``nn.RNN`` layer and its backward in two ops, not ~10 per time step.
RNN_FEATURE = "rnn_layers"
#: The internal op ``torch.sparse_mm`` (``server/execute/sparse_mm.py``): a sparse COO matrix times a dense one.
SPARSE_MM_FEATURE = "sparse_mm"
#: The internal op ``torch.sparse_add`` (the same file): a dense tensor plus ``alpha`` times a sparse one.
SPARSE_ADD_FEATURE = "sparse_add"
#: The internal ops ``torch.rng_state`` / ``torch.set_rng_state``: the session's random stream saved and restored.
RNG_STATE_FEATURE = "rng_state"
#: Several streams per large transfer (``protocol.lanes``); only with ``"data"``.
LANES_FEATURE = "lanes"

# Slice / None / Ellipsis inside an index key (see encode_key in codec).
KEY_SLICE, KEY_NONE, KEY_ELLIPSIS, KEY_ARRAY = "s", "n", "e", "a"
