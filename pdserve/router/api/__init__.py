"""The router's OpenAI surface: request bodies parsed and bounded into what a worker runs, tool
calls, response and SSE bodies, and the router's errors as OpenAI error bodies.

Modules: ``protocol`` (bodies -> prompts and one SamplingParams per choice), ``request_models`` (the
bodies' pydantic models), ``request_fields`` (each field honoured, advisory or rejected; bad fields
named), ``strict`` (the models' base), ``input_limits`` (size bounds), ``jsonlimits`` (the depth bound
on client JSON), ``tools`` (tool models and calls), ``responses`` (response/SSE bodies), ``errors``
(exception tree -> OpenAI error bodies). Nothing here routes or serves: it imports neither
:mod:`pdserve.router.routing` nor :mod:`pdserve.router.http` at run time.
"""
