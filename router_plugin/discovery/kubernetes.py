"""``kubernetes``: pods chosen by a label selector, watched with the official client.

Needs the extra ``mlxcel-plugin[kubernetes]`` and RBAC to list and watch pods
(deploy/kubernetes/ has both). A pod is a node when it is Ready, has an IP, a
role label (``[discovery] kubernetes_role_label``, by default the LWS
DisaggregatedSet's ``disaggregatedset.x-k8s.io/role``) of ``prefill`` or
``decode``, and a container port named ``[discovery] kubernetes_port_name``; its
``mlxcel.io/model-fingerprint`` annotation, when set, is its model fingerprint; its
``mlxcel.io/model`` label, when set, its served model NAME (``served_model.py``).

The client is synchronous: a thread lists the pods (a ``SYNC`` event: the full
set), then watches from that list's version, and starts over when the watch
ends or fails; ``apply_event`` turns each event into membership (pure, tested
with a fake stream).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import (
    NODE_ROLES,
    DiscoveryConfig,
    Member,
    Snapshot,
    host_port,
)
from router_plugin.discovery.served_model import MODEL_LABEL, belongs, pool_model

logger = logging.getLogger(__name__)

SYNC = "SYNC"  # our own event: the full list of pods, replacing what was known
FINGERPRINT_ANNOTATION = "mlxcel.io/model-fingerprint"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 60  # the thread looks at its stop flag at least this often
RESTART_S = 5.0
Event = dict[str, Any]  # {"type": ..., "object": V1Pod (or a list of them for SYNC)}
EventStream = Callable[[threading.Event], Iterator[Event]]


def _ready(pod: Any) -> bool:
    conditions = (pod.status and pod.status.conditions) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _port(pod: Any, port_name: str) -> int | None:
    for container in pod.spec.containers or []:
        for port in container.ports or []:
            if port.name == port_name:
                return port.container_port
    return None


def pod_member(pod: Any, discovery: DiscoveryConfig, source: str = "kubernetes",
               model: str | None = None) -> Member | None:
    """The node a pod is, or None (not ready, no IP, no role, no link port, or the node of
    another model than the pool's ``model``)."""
    labels = pod.metadata.labels or {}
    role = labels.get(discovery.kubernetes_role_label)
    port = _port(pod, discovery.kubernetes_port_name)
    ip = pod.status.pod_ip if pod.status else None
    if role not in NODE_ROLES or port is None or not ip or not _ready(pod):
        return None
    if not belongs(labels.get(MODEL_LABEL), model):
        return None
    fingerprint = (pod.metadata.annotations or {}).get(FINGERPRINT_ANNOTATION)
    return Member(role, host_port(ip, port), fingerprint, source)


def apply_event(members: dict[str, Member], event: Event, discovery: DiscoveryConfig,
                model: str | None = None) -> bool:
    """Update ``members`` (pod name -> node of ``model``) from one event; True when changed."""
    before = dict(members)
    kind, obj = event.get("type"), event.get("object")
    if kind == SYNC:
        members.clear()
        for pod in obj or []:
            member = pod_member(pod, discovery, model=model)
            if member is not None:
                members[pod.metadata.name] = member
    elif kind in ("ADDED", "MODIFIED", "DELETED"):
        member = None if kind == "DELETED" else pod_member(obj, discovery, model=model)
        if member is None:
            members.pop(obj.metadata.name, None)
        else:
            members[obj.metadata.name] = member
    # BOOKMARK and ERROR change nothing; an ERROR ends the watch, and the thread re-lists.
    return members != before


def pod_namespace(discovery: DiscoveryConfig) -> str:
    if discovery.kubernetes_namespace:
        return discovery.kubernetes_namespace
    try:
        return NAMESPACE_FILE.read_text(encoding="utf-8").strip()
    except OSError:
        return "default"


def make_event_stream(discovery: DiscoveryConfig) -> EventStream:
    """List, then watch, with the official client (in-cluster config, else kubeconfig)."""
    from kubernetes import client, config, watch

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api, namespace = client.CoreV1Api(), pod_namespace(discovery)
    selector = discovery.kubernetes_selector

    def stream(stop: threading.Event) -> Iterator[Event]:
        pods = api.list_namespaced_pod(namespace, label_selector=selector)
        yield {"type": SYNC, "object": pods.items}
        watcher = watch.Watch()
        for event in watcher.stream(api.list_namespaced_pod, namespace, label_selector=selector,
                                    resource_version=pods.metadata.resource_version,
                                    timeout_seconds=WATCH_TIMEOUT_S):
            if stop.is_set():
                watcher.stop()
            yield event

    return stream


class KubernetesSource:
    name = "kubernetes"

    def __init__(self, config: ServerConfig, discovery: DiscoveryConfig,
                 stream: EventStream | None = None):
        self.discovery = discovery
        self.model = pool_model(config)
        self._stream = stream
        self.members: dict[str, Member] = {}

    async def watch(self) -> AsyncIterator[Snapshot]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        stop = threading.Event()
        thread = threading.Thread(target=self._pump, args=(stop, loop, events),
                                  name="kubernetes-watch", daemon=True)
        thread.start()
        try:
            yield frozenset()
            while True:  # until aclose()
                event = await events.get()
                if apply_event(self.members, event, self.discovery, self.model):
                    yield frozenset(self.members.values())
        finally:
            stop.set()  # the thread ends at its next event or watch timeout

    def _pump(self, stop: threading.Event, loop: asyncio.AbstractEventLoop,
              events: asyncio.Queue[Event]) -> None:
        while not stop.is_set():
            try:
                stream = self._stream or make_event_stream(self.discovery)
                for event in stream(stop):
                    loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop closed under us: the router is gone
                return
            except Exception as exc:  # no API server (yet): log, list again later
                logger.warning("kubernetes: pod watch failed (%s); retrying in %.0fs", exc,
                               RESTART_S)
                stop.wait(RESTART_S)
