"""An example third-party mlxcel plugin: one balancer and one KV codec.

Loaded through the ``mlxcel`` entry-point group (entry point ``example``);
the hooks live in :mod:`mlxcel_example_plugin.plugin`.
"""

from mlxcel_example_plugin.power_of_two import PowerOfTwoBalancer
from mlxcel_example_plugin.zlib_codec import ZlibCodec

__all__ = ["PowerOfTwoBalancer", "ZlibCodec"]
