"""Built-in load-balancing strategies, one per file; the file's ``name`` is the config value."""

from router_plugin.balancers.base import Balancer, BalancerFactory, NodeView, RequestInfo
from router_plugin.balancers.least_loaded import LeastLoadedBalancer
from router_plugin.balancers.memory_aware import MemoryAwareBalancer
from router_plugin.balancers.prompt_length_aware import PromptLengthAwareBalancer
from router_plugin.balancers.round_robin import RoundRobinBalancer

BUILTIN_BALANCERS: dict[str, BalancerFactory] = {
    RoundRobinBalancer.name: RoundRobinBalancer,
    LeastLoadedBalancer.name: LeastLoadedBalancer,
    MemoryAwareBalancer.name: MemoryAwareBalancer,
    PromptLengthAwareBalancer.name: PromptLengthAwareBalancer,
}

__all__ = [
    "BUILTIN_BALANCERS",
    "Balancer",
    "BalancerFactory",
    "LeastLoadedBalancer",
    "MemoryAwareBalancer",
    "NodeView",
    "PromptLengthAwareBalancer",
    "RequestInfo",
    "RoundRobinBalancer",
]
