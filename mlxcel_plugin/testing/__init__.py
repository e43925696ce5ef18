"""Reusable test helpers and contract suites for plugin authors.

Import from tests (needs pytest)::

    from mlxcel_plugin.testing.codec_contract import CodecContract
    from mlxcel_plugin.testing.transfer_contract import TransferStrategyContract
"""
