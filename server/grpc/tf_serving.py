"""TensorFlow Serving's gRPC API for a predict service, on grpc.aio in the HTTP server's event loop.

    tensorflow.serving.PredictionService/Predict           columnar TensorProto inputs -> outputs
    tensorflow.serving.PredictionService/GetModelMetadata  metadata_field ["signature_def"]
    tensorflow.serving.PredictionService/Classify, Regress INVALID_ARGUMENT: hloserve signatures are predict
                                                           signatures (tensors in, tensors out), not tf.Example ones
    tensorflow.serving.ModelService/GetModelStatus

Requests go through the predict semantics the REST API shares (server/predict.py): the servable check, the signature,
the inputs by name, rank and dtype, admission and the predict batcher (an HTTP and a gRPC request may share
a batch), and the same status and metadata. Errors answer with gRPC status codes and TF Serving's messages
where it has one: NOT_FOUND for another servable, INVALID_ARGUMENT for a bad request, FAILED_PRECONDITION
for an unknown signature (as TF Serving's Predict), UNAVAILABLE while warming up or shutting down,
RESOURCE_EXHAUSTED past --max-pending or the message size bound (--max-body-mib). MultiInference and
HandleReloadConfigRequest are UNIMPLEMENTED.

With an API key, one server interceptor (`ApiKeyInterceptor`) stands in front of every method, the
unknown ones included, as the HTTP app's middleware does for every route: a call without the
metadata `authorization: Bearer KEY` answers UNAUTHENTICATED before any handler runs.
"""
from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Awaitable, Callable

import grpc
from google.protobuf import json_format
from hloserve.runtime.artifact.errors import HloserveError

from ..http.errors import ApiError
from ..predict import (SERVING_DEFAULT, PredictRequestError, check_servable, columnar_to_arrays, model_metadata,
                       model_status, resolve_signature, run_predict)
from .messages import messages
from .tensors import from_array, to_array

if TYPE_CHECKING:
    from ..services import PredictService

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"
# the HTTP status of a shared check's ApiError -> the gRPC code (the inverse of google.rpc's HTTP mapping)
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE}


class _Abort(Exception):
    """An answer with a gRPC code that no HTTP status stands for."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code, self.message = code, message


class TFServingServicer:
    """The handlers, for one predict service."""

    def __init__(self, service: "PredictService", *, max_message_bytes: int):
        self.service = service
        self.max_message_bytes = max_message_bytes

    def methods(self) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
        """Every method served, by service name."""
        m = messages()

        def unary(handler, request, response):
            return grpc.unary_unary_rpc_method_handler(self._answering(handler), request_deserializer=request.FromString,
                                                       response_serializer=response.SerializeToString)
        return {PREDICTION_SERVICE: {
                    "Predict": unary(self.predict, m.PredictRequest, m.PredictResponse),
                    "GetModelMetadata": unary(self.get_model_metadata, m.GetModelMetadataRequest,
                                              m.GetModelMetadataResponse),
                    # Classify and Regress always answer an error: no response message is ever built
                    "Classify": unary(self.classify, m.ClassificationRequest, m.ClassificationRequest),
                    "Regress": unary(self.regress, m.RegressionRequest, m.RegressionRequest)},
                MODEL_SERVICE: {
                    "GetModelStatus": unary(self.get_model_status, m.GetModelStatusRequest, m.GetModelStatusResponse)}}

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        return [grpc.method_handlers_generic_handler(service, methods) for service, methods in self.methods().items()]

    @staticmethod
    def _answering(handler: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
        """The handler with its errors answered as gRPC statuses."""
        async def call(request, context: grpc.aio.ServicerContext):
            try:
                return await handler(request)
            except ApiError as e:
                await context.abort(_CODES.get(e.status, grpc.StatusCode.UNKNOWN), e.message)
            except _Abort as e:
                await context.abort(e.code, e.message)
            except PredictRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return call

    def _servable(self, request) -> str:
        """Check the request's model spec against the servable (TF Serving's errors); its signature key."""
        if not request.HasField("model_spec"):
            raise ApiError(400, "Missing ModelSpec")
        spec = request.model_spec
        if not spec.name:
            raise ApiError(400, "ModelSpec has no name specified.")
        if spec.version_label:
            raise ApiError(400, f"Unrecognized servable version label: {spec.version_label} (hloserve serves one "
                                f"version, {self.service.version}, without labels)")
        check_servable(self.service, spec.name, str(spec.version.value) if spec.HasField("version") else None)
        return spec.signature_name or SERVING_DEFAULT

    async def predict(self, request):
        svc, m = self.service, messages()
        signature = self._servable(request)
        manifest = svc.model.manifest
        try:
            fn = manifest.functions[resolve_signature(signature, manifest)]
        except PredictRequestError as e:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None   # TF Serving's code for it
        names = [t.name for t in fn.outputs]
        wanted = list(request.output_filter) or names
        for i, alias in enumerate(wanted):
            if alias not in names:
                raise ApiError(400, f"output tensor alias not found in signature: {alias} Outputs expected to be "
                                    f"in the set {{{','.join(sorted(names))}}}.")
            if alias in wanted[:i]:
                raise ApiError(400, f"duplicate output tensor alias: {alias}")
        tensors = {k: to_array(v, f"input {k!r}", self.max_message_bytes) for k, v in request.inputs.items()}
        inputs = columnar_to_arrays(tensors, fn.inputs)
        outs = await run_predict(svc, fn.name, inputs)
        response = m.PredictResponse()
        response.model_spec.name = svc.model_name
        response.model_spec.version.value = svc.version
        response.model_spec.signature_name = signature
        for alias in wanted:
            from_array(outs[alias], response.outputs[alias])
        return response

    async def get_model_metadata(self, request):
        m = messages()
        self._servable(request)
        if not request.metadata_field:
            raise ApiError(400, "GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != "signature_def":
                raise ApiError(400, f"Metadata field {field} is not supported")
        meta = model_metadata(self.service)
        response = m.GetModelMetadataResponse(model_spec=json_format.ParseDict(meta["model_spec"], m.ModelSpec()))
        response.metadata["signature_def"].Pack(json_format.ParseDict(meta["metadata"]["signature_def"],
                                                                      m.SignatureDefMap()))
        return response

    async def get_model_status(self, request):
        self._servable(request)
        return json_format.ParseDict(model_status(self.service), messages().GetModelStatusResponse())

    async def classify(self, request):
        self._not_a_predict_method(request, "classification", "tensorflow/serving/classify")

    async def regress(self, request):
        self._not_a_predict_method(request, "regression", "tensorflow/serving/regress")

    def _not_a_predict_method(self, request, what: str, method: str) -> None:
        """Classify/Regress need a signature of that method (tf.Example in); every hloserve signature is a
        predict signature, so these answer as TF Serving does for one."""
        signature = self._servable(request)
        if signature != SERVING_DEFAULT and signature not in self.service.model.manifest.functions:
            raise ApiError(400, f"No signature was found with the name: {signature}")
        raise ApiError(400, f"Expected {what} signature method_name to be {method}. Was: tensorflow/serving/predict "
                            f"(hloserve signatures take tensors: use Predict)")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every call, whatever its method, needs the metadata `authorization: Bearer KEY` (compared as
    bytes in constant time); without it the call answers UNAUTHENTICATED and no handler runs (the
    request is never parsed)."""

    def __init__(self, api_key: str):
        self.key = f"Bearer {api_key}".encode()

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key: send the metadata 'authorization: Bearer KEY'")
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(sent, str):
            sent = sent.encode("utf-8", "surrogateescape")
        if secrets.compare_digest(sent, self.key):
            return await continuation(handler_call_details)
        return self._deny


class GrpcServer:
    """The gRPC server for one predict service: `await start()` and `await stop()` in the HTTP server's loop."""

    def __init__(self, service: "PredictService", host: str, port: int, *, api_key: str | None = None,
                 max_message_bytes: int, stop_grace_s: float = 2.0):
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.servicer = TFServingServicer(service, max_message_bytes=max_message_bytes)
        self.interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
        self.max_message_bytes = max_message_bytes
        self.stop_grace_s = stop_grace_s
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Listen (one line naming the port and the fix if it is taken) and start answering."""
        # so_reuseport off: a second server on the same port fails here instead of sharing its calls
        server = grpc.aio.server(interceptors=self.interceptors,
                                 options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", self.max_message_bytes)])
        server.add_generic_rpc_handlers(self.servicer.handlers())
        try:
            server.add_insecure_port(self.address)
        except RuntimeError:
            raise HloserveError(f"cannot listen for gRPC on {self.address} (is the port in use?); pass --grpc-port N "
                                f"for another port, or --grpc-port 0 to serve HTTP only") from None
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop listening; calls still running get `stop_grace_s` to finish (the drain has waited for them)."""
        if self._server is not None:
            await self._server.stop(self.stop_grace_s)
