"""Built-in load-balancing strategies, one per file; the class's ``name`` is the config value.

The contract they implement (``Balancer``, ``NodeView``, ``RequestInfo``) is the
core's ``mlxcel_plugin.balancer_api``; ``router_plugin.plugin`` registers them.
"""

from router_plugin.balancers.least_loaded import LeastLoadedBalancer
from router_plugin.balancers.memory_aware import MemoryAwareBalancer
from router_plugin.balancers.prefix_aware import PrefixAwareBalancer
from router_plugin.balancers.prompt_length_aware import PromptLengthAwareBalancer
from router_plugin.balancers.round_robin import RoundRobinBalancer

__all__ = [
    "LeastLoadedBalancer",
    "MemoryAwareBalancer",
    "PrefixAwareBalancer",
    "PromptLengthAwareBalancer",
    "RoundRobinBalancer",
]
