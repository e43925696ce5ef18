"""The prefill and decode node roles (``mlxcel-server --node-role prefill|decode``).

Choreography: ``docs/cluster-flow.md``. The pure pieces (frame mapping,
request parsing, the claim book, metrics) are tested without sockets; the
asyncio modules (``prefill_node``, ``decode_node``, ``handoff_*``,
``telemetry``, ``ops_http``) are thin layers that drive the sans-I/O
schedulers, KV serde and transfer strategies.
"""
