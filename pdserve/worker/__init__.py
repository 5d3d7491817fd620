"""One inference instance as a service: Redis registration and heartbeat, the inbox, the splitwise
hand-off, publishing outputs, metrics. It drives a ``pdserve.engine`` engine on one thread."""
