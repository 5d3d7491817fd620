"""The router as a running HTTP service: its settings, the FastAPI/ASGI app and endpoints, the
state the lifespan builds, admission, tenants, metrics, the traffic it publishes, and the Batch API.

Modules: ``settings`` (RouterSettings, flags), ``server`` (``pdserve router``: uvicorn), ``app``
(FastAPI app, route registration, operator endpoints), ``state`` (RouterState: what the lifespan
builds), ``asgi`` (request id, body, the one JSON/error path), ``serving`` and ``tokenize`` (the raw
ASGI endpoints), ``admission`` (slots per choice, the waiting queue), ``tenants`` (a request's tenant),
``metrics`` (every Prometheus metric), ``traffic`` (what the router publishes with its registration),
``batch_api`` (``/v1/files``, ``/v1/batches``).
"""
