"""kvexport's routing model for Triton's Python backend. With several shards, `kvexport triton-repo`
copies this file as REPO/<name>/1/model.py, in front of the shard models REPO/<name>_shard<i> (one
instance each, kvexport/serving/triton_model.py, each with its own cache), and clients keep calling
<name>. Every request goes to the shard its user id hashes to (shard_of), so a user's requests reach
the one cache that holds their history, wherever Triton's scheduler would have sent them.

A wave: each execution of this model takes the requests Triton's dynamic batcher gathered (in
arrival order), packs each shard's users into one request of the package's batch format
(PACK: their histories and candidates concatenated, with their lengths, in one tensor), sends the shards
their packs at once (Triton's BLS API, async_exec) and answers each client from its shard's pack:
its logits, or its own refusal with its code (a BLS response loses an error's code, so the pack
carries each refused user's code and message in an `errors` output, JSON bytes). One BLS call per
shard and wave, not per user: the hop costs the pack, not each request.

Clients can call any model of a repository, the shards too: each pack carries the router's key
(ROUTE_KEY_FILE, read at load time by the router and its shards) as a request parameter, and a shard
refuses any request without it. Nothing a client may see names a server file (client_line).

Order: this model has one instance, so waves run one after the other; a shard has one instance and
no batcher, so it scores its packs in the order they came; within a pack, two requests of one user
are scored one after the other (kvexport.serving.batcher). A user's requests run in arrival order.

The router loads no package: it applies the `python_path` parameter (a virtual environment's site
directory) first, then imports torch and the backend's utilities. Tensors cross through DLPack and
torch, as in the shards (the stub's own numpy conversion assumes the numpy ABI it was built with,
and its DLPack import of a numpy array logs a traceback per tensor).
"""

import asyncio
import json
import os
import re
import site
import traceback

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


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        for directory in filter(None, parameters.get("python_path", "").split(os.pathsep)):
            site.addsitedir(directory)
        import torch
        import triton_python_backend_utils as pb_utils

        self.pb, self.torch = pb_utils, torch
        torch.set_num_threads(int(parameters.get("threads") or 1))  # as the shards: packing needs no team
        self.shards = parameters["shards"].split(",")
        self.input_names = [spec["name"] for spec in config["input"]]
        self.output_name = config["output"][0]["name"]
        folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # REPO/<name>
        self.route_key = {ROUTE_KEY_PARAMETER: read_route_key(os.path.join(folder, ROUTE_KEY_FILE))}

    async def execute(self, requests):
        """Each request's answer; a failure of the router itself fails the wave's requests with one
        line each, its traceback in the server's log only."""
        try:
            return await self._route(requests)
        except Exception as exc:  # noqa: BLE001 — a bug: logged, and no client sees the server's files
            self.pb.Logger.log_error(f"kvexport: the router failed\n{traceback.format_exc()}")
            error = self.pb.TritonError(f"internal error: {client_line(f'{type(exc).__name__}: {exc}')}")
            return [self.pb.InferenceResponse(error=error) for _ in requests]

    async def _route(self, requests):
        pb, torch = self.pb, self.torch
        members: dict[int, list[int]] = {}  # shard -> its requests' indices, in arrival order
        users = []
        responses = [None] * len(requests)
        for index, request in enumerate(requests):
            tensors = {
                name: torch.from_dlpack(pb.get_input_tensor_by_name(request, name).to_dlpack())
                for name in self.input_names
            }
            users.append(tensors)
            user_id = int(tensors["user_id"].reshape(-1)[0])
            mismatch = routing_key_error(request.parameters(), user_id)
            if mismatch is not None:
                responses[index] = pb.InferenceResponse(error=pb.TritonError(mismatch, pb.TritonError.INVALID_ARG))
                continue
            members.setdefault(shard_of(user_id, len(self.shards)), []).append(index)
        calls = []
        for shard, indices in members.items():
            inputs = [pb.Tensor.from_dlpack(PACK, pack(torch, [users[i] for i in indices]))]
            calls.append(
                pb.InferenceRequest(
                    model_name=self.shards[shard],
                    inputs=inputs,
                    requested_output_names=[self.output_name, ERRORS],
                    parameters=self.route_key,
                ).async_exec()
            )
        answers = await asyncio.gather(*calls)
        for indices, answer in zip(members.values(), answers):
            for index, response in zip(indices, self._split(answer, [users[i] for i in indices])):
                responses[index] = response
        return responses

    def _split(self, answer, users):
        """Each user's response from its shard's answer to their pack."""
        pb, torch = self.pb, self.torch
        if answer.has_error():  # the whole pack failed (Triton's error, e.g. the shard is not loaded)
            message = client_line(answer.error().message())
            return [pb.InferenceResponse(error=pb.TritonError(message)) for _ in users]
        logits = torch.from_dlpack(pb.get_output_tensor_by_name(answer, self.output_name).to_dlpack())
        errors = torch.from_dlpack(pb.get_output_tensor_by_name(answer, ERRORS).to_dlpack())
        refused = {e["index"]: e for e in json.loads(bytes(errors.numpy().tobytes()) or b"[]")}
        rows = logits.split([u["candidate_ids"].numel() for u in users])
        out = []
        for index, user_logits in enumerate(rows):
            error = refused.get(index)
            if error is not None:
                code = getattr(pb.TritonError, TRITON_CODES.get(error["code"], "INTERNAL"))
                out.append(pb.InferenceResponse(error=pb.TritonError(client_line(error["message"]), code)))
            else:
                out.append(
                    pb.InferenceResponse(
                        output_tensors=[pb.Tensor.from_dlpack(self.output_name, user_logits[None].contiguous())]
                    )
                )
        return out
