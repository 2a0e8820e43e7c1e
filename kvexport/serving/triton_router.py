"""kvexport's routing model for Triton's Python backend. With several shards, `kvexport triton-repo`
copies this file as REPO/<name>/1/model.py, in front of the shard models REPO/<name>_shard<i> (one
instance each, kvexport/serving/triton_model.py, each with its own cache), and clients keep calling
<name>. Every request goes to the shard its user id hashes to (shard_of), so a user's requests reach
the one cache that holds their history, wherever Triton's scheduler would have sent them.

Order: this model has one instance, and each of its executions sends its requests, in arrival
order, before it waits for any answer; a shard's dynamic batcher queues them first in, first out,
and scores two requests of one user one after the other (kvexport.serving.batcher). Batching: the
router's dynamic batcher gathers the requests that arrive while the shards work, and each shard's
batcher merges what it receives. A shard's answer, or its error with its code (a refusal stays HTTP
400, a capacity refusal 503), is the client's.

The router runs no torch and loads no package: it applies the `python_path` parameter (a
virtual environment's site directory) first, then imports numpy and the backend's utilities.
"""

import asyncio
import json
import os
import site

_MASK = (1 << 64) - 1
# What triton_model.py puts before a shard's refusal when it serves behind this router, and the Triton
# error code of each kvexport refusal code (kvexport.errors.RequestFailed.code).
ROUTED_CODE_PREFIX = "kvexport-code="
TRITON_CODES = {"invalid_request": "INVALID_ARG", "capacity_exceeded": "UNAVAILABLE"}


def shard_of(user_id: int, shards: int) -> int:
    """The shard of a user: splitmix64's finaliser of the id (as unsigned 64 bits) modulo the shard
    count, so that users spread evenly whatever pattern their ids follow."""
    z = (user_id + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % shards


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        for directory in filter(None, parameters.get("python_path", "").split(os.pathsep)):
            site.addsitedir(directory)
        import numpy
        import triton_python_backend_utils as pb_utils

        self.pb, self.numpy = pb_utils, numpy
        self.shards = parameters["shards"].split(",")
        self.input_names = [spec["name"] for spec in config["input"]]
        self.output_name = config["output"][0]["name"]

    async def execute(self, requests):
        calls = [self._forward(request) for request in requests]
        return list(await asyncio.gather(*calls))

    def _forward(self, request):
        """The request sent on to its user's shard now; an awaitable of the client's response."""
        pb = self.pb
        inputs = [pb.get_input_tensor_by_name(request, name) for name in self.input_names]
        # Read through DLPack by this interpreter's numpy: the stub's own conversion (as_numpy)
        # assumes the numpy ABI it was built with (docs/hosting.md, Serving).
        user_id = int(self.numpy.from_dlpack(inputs[self.input_names.index("user_id")]).flatten()[0])
        shard = self.shards[shard_of(user_id, len(self.shards))]
        answer = pb.InferenceRequest(model_name=shard, inputs=inputs,
                                     requested_output_names=[self.output_name]).async_exec()
        return self._response(answer)

    async def _response(self, pending):
        pb = self.pb
        answer = await pending
        if answer.has_error():
            code, message = shard_error(answer.error().message())
            return pb.InferenceResponse(error=pb.TritonError(message, getattr(pb.TritonError, code)))
        return pb.InferenceResponse(output_tensors=[pb.get_output_tensor_by_name(answer, self.output_name)])


def shard_error(message: str) -> tuple[str, str]:
    """(Triton error code's name, the client's message) of a shard's error. A BLS response carries
    its error's message but not its code (it arrives INTERNAL), so a shard's refusal begins with
    ROUTED_CODE_PREFIX and kvexport's code; an error without it (Triton's own) stays INTERNAL."""
    if message.startswith(ROUTED_CODE_PREFIX):
        code, _, rest = message[len(ROUTED_CODE_PREFIX):].partition(" ")
        return TRITON_CODES.get(code, "INTERNAL"), rest
    return "INTERNAL", message
