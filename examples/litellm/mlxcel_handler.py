"""The module the LiteLLM proxy loads from the config's directory (``custom_handler``)."""

from router_plugin.litellm.provider import MlxcelProvider

mlxcel_provider = MlxcelProvider()
