"""Reusable test helpers and contract suites for plugin authors.

Import from tests (the codec/transfer suites need pytest)::

    from mlxcel_plugin.testing.balancer_contract import CONTRACT_CHECKS
    from mlxcel_plugin.testing.codec_contract import CodecContract
    from mlxcel_plugin.testing.transfer_contract import TransferStrategyContract
    from mlxcel_plugin.testing.engine_contract import EngineContract
    from mlxcel_plugin.testing.role_contract import RoleContract
"""
