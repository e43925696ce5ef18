"""The prefill and decode node roles (``mlxcel-server --node-role prefill|decode``).

Choreography: ``docs/cluster-flow.md``. The pure pieces are tested without
sockets: ``kv_wire`` (KV messages ⇄ link frames), ``requests`` (router frames →
engine requests, every field checked), ``decode_allowlist`` (which decode nodes
a prefill node may hand KV to) and ``metrics``. The asyncio modules
(``prefill_node``, ``decode_node``, ``handoff_*``, ``outbox``, ``telemetry``)
are thin layers that drive the sans-I/O schedulers, KV serde and transfer
strategies; the decode node keeps each router's claim on a request in a dict
of its own, by request id. ``ops_server`` serves ``/health`` and ``/metrics``
(uvicorn + Starlette, on the node's event loop); ``roles`` starts it all.
"""
