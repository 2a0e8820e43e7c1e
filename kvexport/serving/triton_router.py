"""Routing users to cache shards, for kvexport's Triton model (kvexport/serving/triton_model.py). With
several shards, `kvexport triton-repo` writes the model clients call, REPO/<name> (one instance),
which holds shard 0's cache, and the internal shard models REPO/<name>_shard<i>, i = 1..K-1 (one
instance each, each with its own cache). Every user goes to the shard their user id hashes to
(shard_of), so a user's requests reach the one cache that holds their history, wherever Triton's
scheduler would have sent them.

A wave: each execution of the public model takes the requests Triton's dynamic batcher gathered (in
arrival order), packs each other shard's users into one request of the package's batch format
(PACK: their histories and candidates concatenated, with their lengths, in one tensor), sends those
shards their packs at once (Triton's BLS API, async_exec), scores shard 0's users itself meanwhile
(on a thread: the package call releases the GIL) and answers each client from its shard's answer:
its logits, or its own refusal with its code (a BLS response loses an error's code, so the pack
carries each refused user's code and message in an `errors` output, JSON bytes; pack_responses).
One BLS call per shard and wave, not per user: the hop costs the pack, not each request.

Clients can call any model of a repository, the shards too: each pack carries the public model's key
(ROUTE_KEY_FILE, read at load time by it and its shards) as a request parameter, and a shard refuses
any request without it. Nothing a client may see names a server file (client_line).

Order: the public model has one instance, so waves run one after the other, and shard 0's users of a
wave are scored before the next wave starts; a shard has one instance and no batcher, so it scores
its packs in the order they came; within a pack, two requests of one user are scored one after the
other (kvexport.serving.batcher). A user's requests run in arrival order.

This module imports nothing beyond the standard library: the model passes in torch, numpy and the
backend's utilities.
"""

import json
import re

_MASK = (1 << 64) - 1
# A shard's request: one int64 tensor PACK holding its users in the package's batch format
# (docs/hosting.md, Requests), each part after the other (pack); its answer: the users' logits
# concatenated (a refused user's rows zero) and ERRORS, a JSON list of {"index", "code", "message"}
# of the refused users, as UTF-8 bytes. One tensor each way: a Python-backend tensor costs its own
# crossing.
PACK = "pack"
ERRORS = "errors"
# kvexport's refusal codes (kvexport.errors.RequestFailed.code) as Triton's error codes.
TRITON_CODES = {"invalid_request": "INVALID_ARG", "capacity_exceeded": "UNAVAILABLE"}
# Every model of a repository answers any client, the shards too. The router proves a pack is its own
# with a key only the server's files hold: ROUTE_KEY_FILE in the router's model folder, written by
# `kvexport triton-repo` (random, readable by its owner only, never in a config, which Triton serves to
# any client), sent with each pack as the request parameter ROUTE_KEY_PARAMETER; a shard refuses a
# request without it (kvexport.serving.triton_model).
ROUTE_KEY_FILE = "route.key"
ROUTE_KEY_PARAMETER = "kvexport-route-key"
# A file path (absolute, relative with a folder, or a source file with its line) in an exception's
# text: the server's, never shown to a client (client_line).
_SERVER_PATH = re.compile(r"(?:[\w.~-]*/[^\s'\",:()]+|\b[\w-]+\.(?:py|cpp|cc|h|hpp|cu|so)\b)(?::\d+)?")


# The routing key a fleet's load balancer hashes on without reading the body: a request header
# carrying the user id, which Triton hands the model as a request parameter when started with
# --http-header-forward-pattern / --grpc-header-forward-pattern matching it; checked against the
# body's user_id (routing_key_error).
ROUTING_HEADER = "kvexport-user-id"


def routing_key_error(parameters: str, user_id: int) -> str | None:
    """Why a request's routing header (in its parameters, Triton's JSON) does not match its user_id;
    None when it matches or is absent."""
    try:
        found = {str(k).lower(): v for k, v in json.loads(parameters or "{}").items()}
    except (ValueError, AttributeError):
        return None
    if ROUTING_HEADER not in found or str(found[ROUTING_HEADER]).strip() == str(user_id):
        return None
    return f"the {ROUTING_HEADER} header says {str(found[ROUTING_HEADER])[:40]!r}, the request's user_id is {user_id}"


def client_line(text: str) -> str:
    """A message a client may see: the first line of text, any server file path in it left out."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return _SERVER_PATH.sub("<server file>", line)


def read_route_key(path: str) -> str:
    """The router's key (ROUTE_KEY_FILE), as the router and its shards read it at load time."""
    with open(path, encoding="ascii") as file:
        return file.read().strip()


def shard_of(user_id: int, shards: int) -> int:
    """The shard of a user: splitmix64's finaliser of the id (as unsigned 64 bits) modulo the shard
    count, so that users spread evenly whatever pattern their ids follow."""
    z = (user_id + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % shards


def pack(torch, users: list[dict]):
    """Users' tensors (the serving signature's, each with Triton's batch dimension of 1) as one
    int64 tensor: [n, context width, user_ids (n), history_lengths (n), num_candidates (n),
    context_ids (n x width), item_ids, action_ids, candidate_ids]."""
    width = users[0]["context_ids"].numel()
    return torch.cat(
        [
            torch.tensor([len(users), width], dtype=torch.int64),
            *(u["user_id"].reshape(-1) for u in users),
            torch.tensor([u["item_ids"].numel() for u in users], dtype=torch.int64),
            torch.tensor([u["candidate_ids"].numel() for u in users], dtype=torch.int64),
            *(u["context_ids"].reshape(-1) for u in users),
            *(u["item_ids"].reshape(-1) for u in users),
            *(u["action_ids"].reshape(-1) for u in users),
            *(u["candidate_ids"].reshape(-1) for u in users),
        ]
    )


def unpack(numpy, packed, width: int | None = None) -> list[dict]:
    """The inverse of pack, on the shard's numpy array: each user's arrays, with Triton's batch
    dimension of 1. A pack whose header does not describe it (ValueError, one line) is refused
    before anything is allocated from its counts; width: the context width it must have."""
    if packed.ndim != 1 or packed.size < 2:
        raise ValueError(f"{PACK} must be a 1-D pack of users, got shape {list(packed.shape)}")
    n, packed_width = int(packed[0]), int(packed[1])
    if not 1 <= n <= packed.size or (width is not None and packed_width != width) or packed_width < 0:
        raise ValueError(f"{PACK}'s header says {n} users of context width {packed_width}: not a pack of users")
    start = 2 + 3 * n + n * packed_width
    if start > packed.size:
        raise ValueError(f"a pack of {packed.size} ids, its header says at least {start}")
    user_ids, lengths, counts = packed[2 : 2 + n], packed[2 + n : 2 + 2 * n], packed[2 + 2 * n : 2 + 3 * n]
    if int(lengths.min()) < 0 or int(counts.min()) < 0:
        raise ValueError(f"{PACK} holds a negative history length or candidate count")
    events, candidates = int(lengths.sum()), int(counts.sum())
    if packed.size != start + 2 * events + candidates:
        raise ValueError(f"a pack of {packed.size} ids, its header says {start + 2 * events + candidates}")
    context = packed[start - n * packed_width : start].reshape(n, packed_width)
    items, actions = packed[start : start + events], packed[start + events : start + 2 * events]
    start += 2 * events
    cuts, candidate_cuts = numpy.cumsum(lengths)[:-1], numpy.cumsum(counts)[:-1]
    splits = zip(numpy.split(items, cuts), numpy.split(actions, cuts), numpy.split(packed[start:], candidate_cuts))
    return [
        {
            "user_id": user_ids[i : i + 1].reshape(1, 1),
            "item_ids": item[None],
            "action_ids": action[None],
            "context_ids": context[i : i + 1],
            "candidate_ids": candidate[None],
        }
        for i, (item, action, candidate) in enumerate(splits)
    ]


def pack_responses(pb, torch, answer, counts: list[int], output_name: str) -> list:
    """Each user's response from their shard's answer to a pack (users of `counts` candidates):
    their logits, or their refusal with its code."""
    if answer.has_error():  # the whole pack failed (Triton's error, e.g. the shard is not loaded)
        message = client_line(answer.error().message())
        return [pb.InferenceResponse(error=pb.TritonError(message)) for _ in counts]
    logits = torch.from_dlpack(pb.get_output_tensor_by_name(answer, output_name).to_dlpack())
    errors = torch.from_dlpack(pb.get_output_tensor_by_name(answer, ERRORS).to_dlpack())
    refused = {e["index"]: e for e in json.loads(bytes(errors.numpy().tobytes()) or b"[]")}
    out = []
    for index, user_logits in enumerate(logits.split(counts)):
        error = refused.get(index)
        if error is not None:
            code = getattr(pb.TritonError, TRITON_CODES.get(error["code"], "INTERNAL"))
            out.append(pb.InferenceResponse(error=pb.TritonError(client_line(error["message"]), code)))
        else:
            tensor = pb.Tensor.from_dlpack(output_name, user_logits[None].contiguous())
            out.append(pb.InferenceResponse(output_tensors=[tensor]))
    return out
