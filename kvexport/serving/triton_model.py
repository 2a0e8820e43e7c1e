"""kvexport's model for Triton's Python backend: `kvexport triton-repo` copies this file as
REPO/<name>/1/model.py. It runs inside Triton's Python-backend stub, not in kvexport's process.

initialize loads the artifact (its files checked against its manifest first) that the repository
holds beside this file, or the one its config's `artifact` parameter names, on the instance's GPU
for a CUDA package, with the `threads` parameter's intra-op CPU threads (default 1), and warms it up
before Triton reports the model ready (kvexport.serving.warmup); then it attaches the remote tier
the `remote`, `remote_write` and `remote_password_file` parameters name; with a `drain_file`
parameter, a thread unloads the model once that file exists. A `python_path` parameter
adds site directories (a virtual environment's) to the stub's interpreter first. execute scores each
Triton batch as calls of distinct users in arrival order (kvexport.serving.batcher) and answers
every request alone: its logits, or its own error — a refused request its one-line message with
INVALID_ARG (HTTP 400), a capacity refusal UNAVAILABLE (HTTP 503, retryable), an unexpected failure
INTERNAL, logged once with its traceback. With several shards the model clients call is the router
(the `shards` parameter names the others): it scores shard 0's users and sends each other shard its
users in one pack a wave; a shard (the `routed` parameter) takes packs instead, several users in the
package's batch format, and answers each pack with their logits and refusals
(kvexport.serving.triton_router). A moment after each batch (at most
every 50 ms), a thread publishes kvexport's counters (the cache's, the batches', the requests')
through the Python backend's custom metrics API, on Triton's own metrics port
(kvexport.serving.metrics names them).
"""

import asyncio
import hmac
import json
import os
import site
import threading
import traceback

import triton_python_backend_utils as pb_utils

# Publishing kvexport's metrics costs one message to the server each, more than a small request's
# own work: a thread does it at most this often, once a batch has run, never on a request's path.
PUBLISH_INTERVAL_S = 0.05
DRAIN_POLL_S = 0.02  # how often the model looks for its drain file, when it has one


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        for directory in filter(None, parameters.get("python_path", "").split(os.pathsep)):
            site.addsitedir(directory)  # its .pth files too (an editable install's)
        import numpy
        import torch

        from kvexport.errors import RequestError, RequestFailed
        from kvexport.remote import DEFAULT_WRITE_POLICY, read_password_file, url_with_password
        from kvexport.serving import triton_router
        from kvexport.serving.batcher import BatchScorer, request_arrays
        from kvexport.serving.metrics import samples
        from kvexport.serving.signature import INPUT_NAMES, LOGITS, client_message
        from kvexport.serving.warmup import load_warm

        # Imported once here (the backend's interpreter finds them only after python_path), used per batch.
        self.torch, self.numpy, self.router = torch, numpy, triton_router
        self.request_failed, self.metric_samples, self.client_message = RequestFailed, samples, client_message
        self.request_error, self.request_arrays = RequestError, request_arrays
        # Triton's error code per kvexport refusal code (kvexport.errors.RequestFailed.code); the
        # stub defines TritonError once the model is being initialised, not at import.
        self.error_codes = {
            code: getattr(pb_utils.TritonError, name) for code, name in triton_router.TRITON_CODES.items()
        }

        self.logger = pb_utils.Logger
        self.instance_name = args.get("model_instance_name", "")
        self.routed = parameters.get("routed") == "true"  # a shard behind kvexport's router: packs in and out
        self.input_names, self.output_name = INPUT_NAMES, LOGITS
        # Relative to this file's folder (a shard's names its router's copy); "artifact" beside it by default.
        artifact = os.path.join(os.path.dirname(os.path.abspath(__file__)), parameters.get("artifact") or "artifact")
        remote = parameters.get("remote") or None
        if remote and parameters.get("remote_password_file"):
            remote = url_with_password(remote, read_password_file(parameters["remote_password_file"]))
        torch.set_num_threads(int(parameters.get("threads") or 1))
        device = f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else None
        self.package = load_warm(artifact, remote, parameters.get("remote_write") or DEFAULT_WRITE_POLICY, device)
        self.scorer = BatchScorer(self.package)
        self.num_tasks = self.package.num_tasks
        # The public model of several shards holds shard 0 and sends the other shards their users.
        self.other_shards = [n for n in parameters.get("shards", "").split(",") if n]
        if self.routed or self.other_shards:  # the key (triton_router.ROUTE_KEY_FILE), relative to this folder
            here = os.path.dirname(os.path.abspath(__file__))
            self.route_key = triton_router.read_route_key(os.path.join(here, parameters["route_key"]))
            self.router_name = parameters.get("router", "the router")
            self.context_width = self.package.config.model.context_width
        if self.other_shards:
            from concurrent.futures import ThreadPoolExecutor

            # Shard 0's users are scored on this thread while the event loop carries the other
            # shards' packs: the package call releases the GIL.
            self.local = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvexport-shard0")
        self.metric_families, self.published = {}, {}
        self._publish_metrics()
        self.scored, self.finalizing = threading.Event(), threading.Event()
        self.publisher = threading.Thread(target=self._publish_while_serving, name="kvexport-metrics", daemon=True)
        self.publisher.start()
        if parameters.get("drain_file"):
            # Not joined by finalize: the unload it starts runs finalize.
            threading.Thread(
                target=self._unload_when_asked,
                args=(parameters["drain_file"], args["model_name"]),
                name="kvexport-drain",
                daemon=True,
            ).start()

    def execute(self, requests):
        """Each request's answer. A failure outside any one request's scoring (a bug) fails the
        batch's requests with one line each; the server's log has its traceback."""
        if self.other_shards:
            return self._route(requests)  # a coroutine: the stub runs it on its event loop
        try:
            if self.routed:
                return [self._execute_pack(request) for request in requests]
            return self._execute_users(requests)
        except Exception as exc:  # noqa: BLE001 — logged; a client never sees the server's files
            self.logger.log_error(f"kvexport: a batch failed unexpectedly\n{traceback.format_exc()}")
            error = pb_utils.TritonError(self._message(exc), pb_utils.TritonError.INTERNAL)
            return [pb_utils.InferenceResponse(error=error) for _ in requests]

    def _execute_users(self, requests):
        inputs = [{name: self._array(request, name) for name in self.input_names} for request in requests]
        results = [None] * len(requests)
        for index, (request, one) in enumerate(zip(requests, inputs)):
            results[index] = self._routing_refusal(request, int(one["user_id"].reshape(-1)[0]))
        scored = iter(self._score([one for one, result in zip(inputs, results) if result is None]))
        results = [next(scored) if result is None else result for result in results]
        self.scored.set()
        return [self._response(result) for result in results]

    async def _route(self, requests):
        """The public model of K shards: each user to the shard their id hashes to, shard 0's here,
        the others' packed per shard and sent at once (BLS), answered as each shard answered."""
        try:
            return await self._route_wave(requests)
        except Exception as exc:  # noqa: BLE001 — logged; a client never sees the server's files
            self.logger.log_error(f"kvexport: a wave failed unexpectedly\n{traceback.format_exc()}")
            error = pb_utils.TritonError(self._message(exc), pb_utils.TritonError.INTERNAL)
            return [pb_utils.InferenceResponse(error=error) for _ in requests]

    async def _route_wave(self, requests):
        torch, router = self.torch, self.router
        inputs = [{name: self._array(request, name) for name in self.input_names} for request in requests]
        responses = [None] * len(requests)
        members = {}  # shard -> its requests' indices, in arrival order
        for index, (request, one) in enumerate(zip(requests, inputs)):
            # A pack holds only requests of one action per item (batcher.request_arrays); the context's
            # width is fixed by the model's config, which Triton enforces. Any other request goes to
            # shard 0's scorer, which refuses (and counts) it alone with the same line.
            try:
                arrays = self.request_arrays(one)
            except self.request_failed:
                members.setdefault(0, []).append(index)
                continue
            user_id = int(arrays["user_id"][0])
            refusal = self._routing_refusal(request, user_id)
            if refusal is not None:
                responses[index] = self._response(refusal)
                continue
            members.setdefault(router.shard_of(user_id, len(self.other_shards) + 1), []).append(index)
        local = members.pop(0, [])
        calls = []
        for shard, indices in members.items():
            packed = router.pack(torch, [{k: torch.from_numpy(v) for k, v in inputs[i].items()} for i in indices])
            calls.append(
                pb_utils.InferenceRequest(
                    model_name=self.other_shards[shard - 1],
                    inputs=[pb_utils.Tensor.from_dlpack(router.PACK, packed)],
                    requested_output_names=[self.output_name, router.ERRORS],
                    parameters={router.ROUTE_KEY_PARAMETER: self.route_key},
                ).async_exec()
            )
        scoring = asyncio.get_running_loop().run_in_executor(self.local, self._score, [inputs[i] for i in local])
        # A failed shard fails its own users only.
        scored, *answers = await asyncio.gather(scoring, *calls, return_exceptions=True)
        for indices, result in [(local, scored), *zip(members.values(), answers)]:
            if isinstance(result, BaseException):
                self.logger.log_error(
                    f"kvexport: a shard's users failed unexpectedly\n{''.join(traceback.format_exception(result))}"
                )
                failed = self._response(result)
                answered = [failed] * len(indices)
            elif indices is local:
                answered = [self._response(one) for one in result]
            else:
                counts = [inputs[i]["candidate_ids"].size for i in indices]
                answered = router.pack_responses(pb_utils, torch, result, counts, self.output_name)
            for index, response in zip(indices, answered):
                responses[index] = response
        self.scored.set()
        return responses

    def _routing_refusal(self, request, user_id):
        """The refusal (counted) of a request whose routing header names another user; None otherwise."""
        mismatch = self.router.routing_key_error(request.parameters(), user_id)
        if mismatch is None:
            return None
        self.scorer.count_refused()
        return self.request_error(mismatch)

    def _score(self, inputs):
        """Each user's logits or exception (kvexport.serving.batcher), in the order given."""
        try:
            return self.scorer.score(inputs)
        except Exception:  # an unexpected failure: found below, request by request (logged there, and
            pass  # outside this handler, so that a user's traceback does not carry the batch's)
        return [self._score_alone(one) for one in inputs]

    def _execute_pack(self, request):
        """A shard's answer to its router's pack (kvexport.serving.triton_router): the users'
        logits concatenated, a refused user's rows zero, and the refusals with their codes."""
        np, torch = self.numpy, self.torch
        refusal = self._foreign_pack(request)
        if refusal is not None:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal, pb_utils.TritonError.INVALID_ARG))
        inputs = self.router.unpack(np, self._array(request, self.router.PACK), self.context_width)
        results = self._score(inputs)
        self.scored.set()
        rows, errors = [], []
        for index, (one, result) in enumerate(zip(inputs, results)):
            if isinstance(result, BaseException):
                code = result.code if isinstance(result, self.request_failed) else "internal"
                errors.append({"index": index, "code": code, "message": self._message(result)})
                rows.append(torch.zeros(one["candidate_ids"].size, self.num_tasks))
            else:
                rows.append(result.detach().float().cpu())
        logits = torch.cat(rows).contiguous()
        encoded = torch.frombuffer(bytearray(json.dumps(errors).encode()), dtype=torch.uint8)
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor.from_dlpack(self.output_name, logits),
                pb_utils.Tensor.from_dlpack(self.router.ERRORS, encoded),
            ]
        )

    def _foreign_pack(self, request):
        """Why a shard refuses a request its router did not send (a client calling the shard itself):
        None for the router's, which carries the router's key among its parameters."""
        try:
            key = json.loads(request.parameters() or "{}").get(self.router.ROUTE_KEY_PARAMETER)
        except (ValueError, AttributeError):
            key = None
        if isinstance(key, str) and hmac.compare_digest(key.encode(), self.route_key.encode()):
            return None
        return (
            f"{self.router.PACK}: this model takes packs from the model {self.router_name} only; "
            f"send each user's request to {self.router_name}"
        )

    def _message(self, result):
        """A failure's one-line message for the client, naming no file of the server's."""
        if isinstance(result, self.request_failed):
            return self.router.client_line(self.client_message(str(result)))
        return f"internal error: {self.router.client_line(f'{type(result).__name__}: {result}')}"

    def _unload_when_asked(self, drain_file, model_name):
        """Unloads this model through the Python backend's model-loading API once drain_file exists
        (`kvexport serve` stopping): Triton then refuses new requests, answers those it accepted and
        runs finalize. In-process, so no endpoint (and no token) is needed."""
        while not self.finalizing.wait(DRAIN_POLL_S):
            if os.path.exists(drain_file):
                pb_utils.unload_model(model_name)
                return

    def _publish_while_serving(self):
        while not self.finalizing.is_set():
            if self.scored.wait(timeout=1.0):
                self.finalizing.wait(PUBLISH_INTERVAL_S)  # batches of the next moment join this update
                self.scored.clear()
                self._publish_metrics()

    def _publish_metrics(self):
        """Triton's metrics: a counter moves by what it grew since the last update, a gauge is set
        when it changed."""
        for sample in self.metric_samples(
            self.package.name, self.package.stats(), self.scorer.counters(), self.instance_name
        ):
            family = self.metric_families.get(sample.name)
            if family is None:
                kind = pb_utils.MetricFamily.COUNTER if sample.kind == "counter" else pb_utils.MetricFamily.GAUGE
                family = self.metric_families[sample.name] = pb_utils.MetricFamily(
                    name=sample.name, description=sample.help, kind=kind
                )
            key = (sample.name, sample.labels)
            if key not in self.published:
                self.published[key] = [family.Metric(labels=dict(sample.labels)), None]
            metric, last = self.published[key]
            if sample.kind == "counter":
                if sample.value > (last or 0):
                    metric.increment(sample.value - (last or 0))
            elif sample.value != last:
                metric.set(sample.value)
            self.published[key][1] = sample.value

    def _array(self, request, name):
        """An input as a numpy array, through DLPack and torch: the stub's own numpy conversion
        assumes the numpy ABI it was built with, which the interpreter's numpy need not have."""
        return self.torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, name).to_dlpack()).numpy()

    def _score_alone(self, inputs):
        try:
            return self.scorer.score([inputs])[0]
        except Exception as exc:
            self.logger.log_error(f"kvexport: a request failed unexpectedly\n{traceback.format_exc()}")
            return exc

    def _response(self, result):
        if isinstance(result, self.request_failed):
            code = self.error_codes.get(result.code, pb_utils.TritonError.INTERNAL)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(self._message(result), code))
        if isinstance(result, BaseException):
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(self._message(result), pb_utils.TritonError.INTERNAL)
            )
        logits = result.detach().float().cpu().contiguous()[None]  # [1, T, num_tasks]: Triton's batch dimension
        return pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(self.output_name, logits)])

    def finalize(self):
        self.finalizing.set()
        self.scored.set()  # wakes the publisher, which then ends
        self.publisher.join()
        # The metric objects go now, while the stub runs: freed at its exit, after its shared memory,
        # they crash it (SIGSEGV in MetricFamily's destructor, seen with gdb).
        self.published.clear()
        self.metric_families.clear()
        if self.other_shards:
            self.local.shutdown()
        self.package.close()
