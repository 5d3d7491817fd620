"""Batch workers: the Batch API's lines run on rq (``pdserve batch-worker``).

A batch worker is a router without an HTTP listener: it runs each line through the same endpoint
code, dispatch, retries and migration as an online request, in spare capacity only. It sits above
the router (it imports it; nothing below imports it).
"""
