"""Every error the server answers, in OpenAI's shape and never with a stack trace: ApiError (raised
anywhere in a request), its JSON body, and the app's handlers that turn any exception into one."""
import json
import logging

logger = logging.getLogger("vlinfer.serve")


class ApiError(Exception):
    """Raised anywhere in a request; the app turns it into the OpenAI error body with this
    status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type or error_type(status)


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error" if status == 500 else "service_unavailable_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type or error_type(status),
                                 "param": param, "code": code}}).encode()


def add_error_handlers(app) -> None:
    """The app's exception handlers: ApiError, FastAPI's own validation, routing (404, 405) and
    anything unhandled (500, its trace in the server log only)."""
    # Imported here: the config imports this module (through security.py) and needs no FastAPI.
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def error(status: int, message: str, param=None, code=None, type=None,
              headers=None) -> Response:
        return Response(error_body(status, message, param, code, type), status_code=status,
                        media_type="application/json", headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error(e.status, e.message, e.param, e.code, e.type, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"invalid request: {loc}: {first.get('msg', 'invalid')}", loc or None,
                     "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        path = request.url.path
        message = {404: f"no route {path!r}",
                   405: f"method {request.method} is not allowed on {path!r}"}.get(
            e.status_code, str(e.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error(e.status_code, message, code=code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
        return error(500, "internal server error; see the server log", code="internal_error")
