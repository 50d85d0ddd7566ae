"""Errors the routes raise (answered in the API's own format by app.py) and admission to the device."""
from __future__ import annotations

RETRY_AFTER = "1"


class ApiError(Exception):
    """An HTTP error answer: status, message and the OpenAI error fields (TF Serving uses the message)."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        self.status, self.message, self.type_, self.param, self.headers = status, message, type_, param, headers


def check_model(service, name: str) -> None:
    """404 in OpenAI's words unless `name` is one of the names the service is served under (or a LoRA
    adapter it has loaded)."""
    adapters = getattr(service, "adapter_names", ())
    if name not in service.model_names and name not in adapters:
        served = ", ".join(f"'{n}'" for n in (*service.model_names, *adapters))
        raise ApiError(404, f"model '{name}' does not exist; this server serves {served}",
                       type_="not_found_error", param="model")


def admit(service) -> None:
    """Count a request in (503 while warming up, 429 past max_pending); the caller releases it."""
    if service.readiness.draining:
        raise ApiError(503, "the server is shutting down; retry on another replica", type_="service_unavailable",
                       headers={"Retry-After": RETRY_AFTER})
    if not service.readiness.ready:
        raise ApiError(503, "the model is warming up; retry shortly" if not service.readiness.error
                       else f"the model failed to load: {service.readiness.error}", type_="service_unavailable",
                       headers={"Retry-After": RETRY_AFTER})
    if not service.admission.try_enter():
        raise ApiError(429, f"server overloaded: {service.admission.limit} requests in flight; retry later",
                       type_="rate_limit_error", headers={"Retry-After": RETRY_AFTER})


SHUTTING_DOWN = "the server shut down before the request finished"
